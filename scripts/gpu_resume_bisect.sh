#!/usr/bin/env bash
# Which part of a checkpoint makes a 2-GPU -> 1-GPU resume train differently (issue 6)?
# 1. save: the 750m on 2 GPUs (FSDP2), SAVE_STEP steps, a full checkpoint at SAVE_STEP (run by
#    scripts/gpu_scaling.sh with CONT_STEPS=1, so its table also has the 2-GPU scaling point).
# 2. that checkpoint resumed on 1 GPU (global batch kept: 2 microbatches of 4) to END_STEP, once
#    per variant, two lanes side by side (GPU 0, GPU 1):
#      full         everything loaded (the resume in question)
#      no_data      --checkpoint.exclude_from_loading dataloader (reads from the data's start)
#      no_optim     ... optimizer (fresh NorMuon/CautiousAdamW state, same lr)
#      model_only   ... dataloader,optimizer,lr_scheduler (lr from the schedule's step 1)
#    and, on GPU 1 last, fresh_1gpu: 1 GPU from scratch to END_STEP with the same batch shape.
# The summary lists, per run, main CE and loss at every step after SAVE_STEP.
# Machine: carry [".whl", "data/brown", "assets/tokenizer"], kind nvidia-h200-x2,
# "bash scripts/gpu_resume_bisect.sh" (about 5 minutes). Under $OUT: the logs and summary.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
T0=$SECONDS
RESULTS=${OUT:-outputs/gpu_resume_bisect}
RUN_DIR=${RUN_DIR:-outputs/gpu_resume_bisect_run}
SAVE_STEP=${SAVE_STEP:-20}
END_STEP=${END_STEP:-26}
RUN_TIMEOUT=${RUN_TIMEOUT:-110}
CONFIG=train_configs/hymo_750m.toml
mkdir -p "${RESULTS}" "${RUN_DIR}"
stamp() { echo "[+$(printf '%3d' $((SECONDS - T0)))s $(date +%T)] $*"; }

SITE=${SITE:-/tmp/site} NAME=gpu_resume_bisect . scripts/gpu_env.sh
OUT=/tmp/gpu_resume_bisect_scaling RUN_DIR="${RUN_DIR}" NGPUS=2 RESUME_NGPUS="" \
    SAVE_STEP="${SAVE_STEP}" CONT_STEPS=1 DEADLINE_S=200 bash scripts/gpu_scaling.sh \
    > "${RESULTS}/save_2gpu.txt" 2>&1 || true
tail -n 8 "${RESULTS}/save_2gpu.txt"
SAVED="${RUN_DIR}/scale_2gpu/checkpoint/step-${SAVE_STEP}"
[ -f "${SAVED}/.metadata" ] || { echo "no checkpoint ${SAVED}"; exit 1; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCHINDUCTOR_CACHE_DIR=/tmp/hymo_scaling_compile_cache
export TRITON_CACHE_DIR=/tmp/hymo_scaling_compile_cache/triton
COMMON=(--metrics.log_freq 1 --debug.seed 42 --lr_scheduler.total_steps 57220
        --training.steps "${END_STEP}" --training.local_batch_size 4
        --training.global_batch_size 8)

run() {  # run NAME GPU [overrides...]; links the checkpoint unless NAME is fresh_*
    local name=$1 gpu=$2; shift 2
    rm -rf "${RUN_DIR:?}/${name}"
    mkdir -p "${RUN_DIR}/${name}/checkpoint"
    [[ ${name} == fresh_* ]] || ln -s "$(cd "${SAVED}" && pwd)" \
        "${RUN_DIR}/${name}/checkpoint/step-${SAVE_STEP}"
    stamp "start ${name} on GPU ${gpu}"
    local rc=0
    CUDA_VISIBLE_DEVICES=${gpu} NGPU=1 LOG_RANK=0 CONFIG_FILE="${CONFIG}" \
        timeout -k 20 "${RUN_TIMEOUT}" ./run_train.sh --job.dump_folder "${RUN_DIR}/${name}" \
        "${COMMON[@]}" "$@" 2>&1 | sed -u -E 's/\x1b\[[0-9;]*[A-Za-z]//g' \
        > "${RESULTS}/${name}.log" || rc=$?
    stamp "end ${name}: exit ${rc}"
}
LOAD=(--checkpoint.enable --checkpoint.load_only)
lane0() {
    run full 0 "${LOAD[@]}"
    run no_optim 0 "${LOAD[@]}" --checkpoint.exclude_from_loading optimizer
}
lane1() {
    run no_data 1 "${LOAD[@]}" --checkpoint.exclude_from_loading dataloader
    run model_only 1 "${LOAD[@]}" --checkpoint.exclude_from_loading dataloader,optimizer,lr_scheduler
    run fresh_1gpu 1 --checkpoint.no-enable
}
lane0 & lane1 & wait
stamp "runs done"
python3 - "${RESULTS}" "${SAVE_STEP}" <<'PYEOF' | tee "${RESULTS}/summary.txt"
import re
import sys
from pathlib import Path

out, save = Path(sys.argv[1]), int(sys.argv[2])
step_re = re.compile(r"step:\s*(\d+)\s+loss:\s*(\S+)")
ce_re = re.compile(r"main_ce: (\S+)")
for name in ("full", "no_data", "no_optim", "model_only", "fresh_1gpu"):
    path = out / f"{name}.log"
    if not path.exists():
        print(f"{name:>11}: no log")
        continue
    ce, rows = None, []
    for line in path.read_text().splitlines():
        if (m := ce_re.search(line)):
            ce = float(m.group(1))
        if (m := step_re.search(line)):
            rows.append((int(m.group(1)), float(m.group(2)), ce))
    print(f"{name:>11}: " + "  ".join(f"{s}:{c:.3f}" for s, _, c in rows if c is not None)
          + ("" if rows else " no step logged"))
print("(main CE per step; the uninterrupted 2-GPU run stays at ~9.16 over steps 21-30)")
PYEOF
echo "gpu_resume_bisect: $((SECONDS - T0)) s"
