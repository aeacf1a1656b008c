#!/usr/bin/env bash
# GPU checks behind a checkpoint resume, one GPU per run, two lanes side by side on a machine of
# 2 GPUs (issue 6: a 2-GPU checkpoint resumed on 1 GPU with 2 microbatches trained much faster
# than the uninterrupted run). Each lane isolates one ingredient of that resume:
#
#   lane 0 (GPU_A, 0): gradient accumulation. accum: local batch 4, global 8 (2 microbatches);
#                   noaccum: local batch 8, global 8. Same seed, same sequences, same lr: the
#                   losses must agree to bf16 noise.
#   lane 1 (GPU_B, 1): resume on the same DP degree. ref: local 4, global 4, STEPS steps, a full
#                   checkpoint at SAVE_STEP; resumed: that checkpoint continued to STEPS. Same
#                   sequences (same DP degree): the losses must agree to bf16 noise.
#
# Config: CONFIG (train_configs/hymo_750m.toml: bf16, compile, selective AC, Triton GDN, NorMuon +
# CautiousAdamW), lr schedule pinned to 57,220 steps like scripts/gpu_scaling.sh (every step is
# in the warmup, lr ~1-2 % of peak). Extra arguments go to every run. With GPU_A = GPU_B the
# lanes run one after the other on that GPU.
# Machine: carry [".whl", "data/brown", "assets/tokenizer"], kind nvidia-h200-x2,
# "bash scripts/gpu_resume_check.sh" (about 4 minutes). Under $OUT (else
# outputs/gpu_resume_check): one log per run and summary.txt. DRY=1 runs it on CPU with the
# debug model (fp32, no compile), 1 process per run.
set -euo pipefail
cd "$(dirname "$0")/.."
T0=$SECONDS
RESULTS=${OUT:-outputs/gpu_resume_check}
RUN_DIR=${RUN_DIR:-outputs/gpu_resume_check_run}
if [ "${DRY:-0}" = 1 ]; then
    CONFIG=${CONFIG:-train_configs/debug_model.toml}
    STEPS=${STEPS:-8} SAVE_STEP=${SAVE_STEP:-4}
    EXTRA=(--validation.no-enable)
else
    CONFIG=${CONFIG:-train_configs/hymo_750m.toml}
    STEPS=${STEPS:-16} SAVE_STEP=${SAVE_STEP:-8}
    EXTRA=()
fi
RUN_TIMEOUT=${RUN_TIMEOUT:-170}
GPU_A=${GPU_A:-0} GPU_B=${GPU_B:-1}
mkdir -p "${RESULTS}" "${RUN_DIR}"
stamp() { echo "[+$(printf '%3d' $((SECONDS - T0)))s $(date +%T)] $*"; }

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
COMPILE_CACHE=${COMPILE_CACHE:-/tmp/hymo_scaling_compile_cache}
export TORCHINDUCTOR_CACHE_DIR="${COMPILE_CACHE}" TRITON_CACHE_DIR="${COMPILE_CACHE}/triton"
export TORCHINDUCTOR_FX_GRAPH_CACHE=1 TORCHINDUCTOR_AUTOGRAD_CACHE=1
SITE=${SITE:-/tmp/site} NAME=gpu_resume_check . scripts/gpu_env.sh
COMMON=(--metrics.log_freq 1 --debug.seed 42 --lr_scheduler.total_steps 57220
        --training.steps "${STEPS}" ${EXTRA[@]+"${EXTRA[@]}"} "$@")

run() {  # run NAME GPU [overrides...]
    local name=$1 gpu=$2; shift 2
    stamp "start ${name} on GPU ${gpu}"
    local rc=0
    if [ "${DRY:-0}" = 1 ]; then unset CUDA_VISIBLE_DEVICES; else export CUDA_VISIBLE_DEVICES=${gpu}; fi
    NGPU=1 LOG_RANK=0 CONFIG_FILE="${CONFIG}" timeout -k 20 "${RUN_TIMEOUT}" ./run_train.sh \
        --job.dump_folder "${RUN_DIR}/${name}" "${COMMON[@]}" "$@" 2>&1 \
        | sed -u -E 's/\x1b\[[0-9;]*[A-Za-z]//g' > "${RESULTS}/${name}.log" || rc=$?
    stamp "end ${name}: exit ${rc}"
    [ "${rc}" = 0 ] || grep -v '^\s*\(File\|\^\)' "${RESULTS}/${name}.log" | tail -n 8
}

lane0() {
    run accum "${GPU_A}" --training.local_batch_size 4 --training.global_batch_size 8 --checkpoint.no-enable
    run noaccum "${GPU_A}" --training.local_batch_size 8 --training.global_batch_size 8 --checkpoint.no-enable
}
lane1() {
    run ref "${GPU_B}" --training.local_batch_size 4 --training.global_batch_size 4 --checkpoint.enable \
        --checkpoint.interval "${SAVE_STEP}" --checkpoint.last_save_model_only
    local saved="${RUN_DIR}/ref/checkpoint/step-${SAVE_STEP}"
    rm -rf "${RUN_DIR}/resumed"
    mkdir -p "${RUN_DIR}/resumed/checkpoint"
    ln -s "$(cd "${saved}" && pwd)" "${RUN_DIR}/resumed/checkpoint/step-${SAVE_STEP}"
    run resumed "${GPU_B}" --training.local_batch_size 4 --training.global_batch_size 4 \
        --checkpoint.enable --checkpoint.load_only
}
rm -rf "${RUN_DIR:?}"/{accum,noaccum,ref,resumed}
if [ "${DRY:-0}" = 1 ] || [ "${GPU_A}" = "${GPU_B}" ]; then lane1; lane0; else lane0 & lane1 & wait; fi
stamp "runs done"

python3 - "${RESULTS}" "${SAVE_STEP}" <<'PYEOF' | tee "${RESULTS}/summary.txt"
import sys
sys.path.insert(0, "scripts")
from pathlib import Path
from scaling_table import LOSS, read_log

out, save = Path(sys.argv[1]), int(sys.argv[2])
runs = {n: read_log(out / f"{n}.log")[0] for n in ("accum", "noaccum", "ref", "resumed")}
for a, b, what in (("accum", "noaccum", "gradient accumulation (2 x 4) vs one batch of 8"),
                   ("resumed", "ref", f"resume at step {save} vs uninterrupted, same DP degree")):
    la, lb = runs[a].get(LOSS, {}), runs[b].get(LOSS, {})
    steps = sorted(s for s in la if s in lb and (a != "resumed" or s > save))
    print(f"{what}:")
    if not steps:
        print(f"  no common steps ({a}: {len(la)}, {b}: {len(lb)} logged)")
        continue
    for s in steps:
        print(f"  step {s:>3}: {b} {lb[s]:.4f}  {a} {la[s]:.4f}  diff {la[s] - lb[s]:+.4f}")
    d = [abs(la[s] - lb[s]) for s in steps]
    print(f"  max |diff| {max(d):.4f}; loss moved {la[steps[-1]] - la[steps[0]]:+.4f} ({a}) vs "
          f"{lb[steps[-1]] - lb[steps[0]]:+.4f} ({b}) over steps {steps[0]}-{steps[-1]}")
PYEOF
echo "gpu_resume_check: $((SECONDS - T0)) s"
