#!/usr/bin/env bash
# NorMuon + CautiousAdamW against TorchTitan's AdamW on one GPU: hymo_small for 200 steps with
# each (same seed, so the same initial weights; the same deterministic data order), through
# run_train.sh, then a table (scripts/optim_compare_table.py): final loss (mean of the last 10
# steps), tokens/s, and the optimizer step's time and share of the step time (HyMo's container
# times its step with CUDA events, hymo_recipes/optim/container.py StepTimer).
#
# Shape: the config's own, 4 x 4096 tokens per step, 200 steps = 3.3 M tokens, i.e. about 2.3
# passes over the embedded Brown Corpus train split (1.4 M tokens): a short-horizon comparison
# on repeated data, one seed, untuned AdamW lr (the config's optimizer.lr, 3e-4; set
# ADAMW_LR=... to try another). Schedule for both: HyMo's WSD (2% / 83% / 15%) over the 200
# steps. No checkpoints, no validation. Expected wall time on one H200: about 2 minutes per run
# (~45 s of it compiling), under 8 minutes in all (half that on two GPUs, where the runs go
# side by side); each run is cut at RUN_TIMEOUT seconds.
#
# Like scripts/gpu_smoke.sh, for a machine with the repository copy but no HyMo install and no
# network; carry [".whl", "data/brown", "assets/tokenizer"], run "bash scripts/gpu_optim_compare.sh"
# (logs, tensorboard events and table.txt under $OUT when set, else outputs/gpu_optim_compare).
# DRY=1 runs the same logic on CPU with the debug config for 6 steps (checks the script).
# Extra arguments go to both runs (e.g. --training.seq_len 2048).
set -euo pipefail
cd "$(dirname "$0")/.."

SITE=${SITE:-/tmp/site}
RESULTS=${OUT:-outputs/gpu_optim_compare}
RUN_DIR=${RUN_DIR:-outputs/gpu_optim_compare_run}
RUN_TIMEOUT=${RUN_TIMEOUT:-210}
if [ "${DRY:-0}" = 1 ]; then
    CONFIG=train_configs/debug_model.toml STEPS=${STEPS:-6}
    EXTRA=(--validation.no-enable)
else
    CONFIG=train_configs/hymo_small.toml STEPS=${STEPS:-200}
    EXTRA=()
fi
mkdir -p "${RESULTS}"

NAME=gpu_optim_compare . scripts/gpu_env.sh

if [ "${DRY:-0}" != 1 ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
python3 -c "import torch, triton, torchtitan; print('torch', torch.__version__, '| triton', triton.__version__, '| torchtitan', torchtitan.__version__)"

status=0
run() {  # run NAME GPU [overrides...]
    local name=$1 gpu=$2; shift 2
    rm -rf "${RUN_DIR:?}/${name}"
    local start=$SECONDS
    set +e
    CUDA_VISIBLE_DEVICES=${gpu} NGPU=1 LOG_RANK=0 CONFIG_FILE="${CONFIG}" timeout "${RUN_TIMEOUT}" ./run_train.sh \
        --training.steps "${STEPS}" --metrics.log_freq 1 --debug.seed 42 --checkpoint.no-enable \
        --job.dump_folder "${RUN_DIR}/${name}" ${EXTRA[@]+"${EXTRA[@]}"} "$@" > "${RESULTS}/${name}.log" 2>&1
    local rc=$?
    set -e
    echo "${name}: exit ${rc}, $((SECONDS - start)) s wall"
    if [ "${rc}" -ne 0 ]; then
        tail -n 30 "${RESULTS}/${name}.log" | sed -E 's/\x1b\[[0-9;]*m//g'
    fi
    cp -r "${RUN_DIR}/${name}/tb" "${RESULTS}/tb_${name}" 2>/dev/null || true
    return "${rc}"
}

# Two GPUs: both runs at once, one per GPU (same model, data and seed; nothing shared but the
# host). One GPU (or CPU): one after the other.
if [ "${DRY:-0}" != 1 ] && [ "$(nvidia-smi --list-gpus | wc -l)" -ge 2 ]; then
    run normuon 0 "$@" & pid=$!
    run adamw 1 --optimizer.name AdamW ${ADAMW_LR:+--optimizer.lr "${ADAMW_LR}"} "$@" || status=$?
    wait "${pid}" || status=$?
else
    run normuon "${CUDA_VISIBLE_DEVICES:-0}" "$@" || status=$?
    run adamw "${CUDA_VISIBLE_DEVICES:-0}" --optimizer.name AdamW ${ADAMW_LR:+--optimizer.lr "${ADAMW_LR}"} "$@" || status=$?
fi

echo "================ gpu_optim_compare: ${CONFIG}, ${STEPS} steps, seed 42 ================"
python3 scripts/optim_compare_table.py "NorMuon+CautiousAdamW=${RUN_DIR}/normuon" \
    "AdamW (TorchTitan's)=${RUN_DIR}/adamw" | tee "${RESULTS}/table.txt" || status=1
exit "${status}"
