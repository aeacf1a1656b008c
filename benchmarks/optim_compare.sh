#!/usr/bin/env bash
# NorMuon + CautiousAdamW against TorchTitan's AdamW on one GPU: hymo_small for 200 steps with
# each (same seed, so the same initial weights; the same deterministic data order), through
# run_train.sh, then a table (benchmarks/optim_compare_table.py): final loss (mean of the last
# 10 steps), tokens/s, and the optimizer step's time and share of the step time (HyMo's
# container times its step with CUDA events, hymo_recipes/titan/optimizers.py StepTimer).
#
# Shape: ab_seeds.sh's, 4 x 4096 tokens per step, 200 steps = 3.3 M tokens, i.e. about 2.3
# passes over the embedded Brown Corpus train split (1.4 M tokens): a short-horizon comparison
# on repeated data, one seed, untuned AdamW lr (the config's optimizer.lr, CautiousAdamW's; set
# ADAMW_LR=... to try another). Schedule for both: HyMo's WSD (2% / 83% / 15%) over the 200
# steps. No checkpoints, no validation. A run takes about 2 minutes on one H200, so the pair
# fits one 10-minute call (on two GPUs they go side by side); each run is cut at RUN_TIMEOUT
# seconds (default 210).
#
# For a bare GPU machine (scripts/gpu_env.sh): carry .whl/, data/brown/ and assets/tokenizer/;
# logs, tensorboard events and table.txt under $OUT when set, else outputs/optim_compare.
# DRY=1 runs the same logic on CPU with the debug config for 6 steps (checks the script).
# Extra arguments go to both runs (e.g. --training.seq_len 2048). The runs and the table are
# benchmarks/ab_seeds.sh's, with one seed (42).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${DRY:-0}" = 1 ]; then
    export STEPS=${STEPS:-6}
fi
OUT=${OUT:-outputs/optim_compare} RUN_DIR=${RUN_DIR:-outputs/optim_compare_run} \
RUN_TIMEOUT=${RUN_TIMEOUT:-210} SEEDS=42 A_NAME=NorMuon-CautiousAdamW A_ARGS= B_NAME=AdamW \
B_ARGS="--optimizer.name AdamW --optimizer.no-cuda_graph${ADAMW_LR:+ --optimizer.lr ${ADAMW_LR}}" exec benchmarks/ab_seeds.sh "$@"
