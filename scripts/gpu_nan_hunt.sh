#!/usr/bin/env bash
# Where does NorMuon's NaN (hymo_small, seq 2048, one H200) come from? Seen: with compile and
# bf16 the loss goes NaN at data-dependent steps (19-23 in one run, 181/182/184 in another);
# without compile, or with fp32 parameters, 200 steps stayed finite. Four runs at once (two per
# GPU on a 2-GPU machine), compile on: two seeds plain, the same two with [hymo] nonfinite_probe,
# which names the unit that turned finite inputs into NaN and replays it eagerly.
# carry [".whl", "data/brown", "assets/tokenizer"]; logs under $OUT, a digest printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
SITE=${SITE:-/tmp/site}
RESULTS=${OUT:-outputs/gpu_nan_hunt}
RUN_TIMEOUT=${RUN_TIMEOUT:-200}
mkdir -p "${RESULTS}"
NAME=gpu_nan_hunt . scripts/gpu_env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NG=$(nvidia-smi --list-gpus | wc -l)
common=(--training.steps 200 --training.seq_len 2048 --metrics.log_freq 1 --debug.seed 42
        --checkpoint.no-enable --validation.no-enable)
launch() {  # launch NAME GPU [overrides]
    local name=$1 gpu=$2; shift 2
    CUDA_VISIBLE_DEVICES=$gpu NGPU=1 LOG_RANK=0 CONFIG_FILE=train_configs/hymo_small.toml \
        timeout "${RUN_TIMEOUT}" ./run_train.sh "${common[@]}" --job.dump_folder "outputs/nan_${name}" "$@" \
        2>&1 | sed -E 's/\x1b\[[0-9;]*m//g' > "${RESULTS}/${name}.log" &
}
# Two seeds without the probe (how often does it happen?), the same two with it (where?).
for i in 0 1; do
    launch "seed$i" $((i % NG)) --debug.seed $((42 + i))
    launch "probe$i" $((i % NG)) --debug.seed $((42 + i)) --hymo.nonfinite_probe
done
wait
for n in seed0 probe0 seed1 probe1; do
    echo "================ ${n}"
    grep -E "step: +(1|50|100|150|200) " "${RESULTS}/${n}.log" | grep -o -E "step: +[0-9]+ +loss: +[0-9.a-z]+ +grad_norm: +[0-9.a-z]+" | head -14
    grep -E "WARNING|Error|error" "${RESULTS}/${n}.log" | grep -v -E "UserWarning|warnings.warn|lspci|TORCH_NCCL|re-looped|nonfinite_probe is on" | head -6 | cut -c1-1500
    echo "skipped steps: $(grep -c 'optimizer step skipped' "${RESULTS}/${n}.log")"
    grep -E "nonfinite_probe: forward" "${RESULTS}/${n}.log" | head -4 | cut -c1-1500
done
