#!/usr/bin/env bash
# Where one training step's GPU time goes: a short run_train.sh with TorchTitan's profiler on
# for the last step, then benchmarks/trace_breakdown.py on its trace (GPU ms per category: the
# GDN kernel, attention, grouped GEMMs of the MoE experts, other GEMMs, Inductor's fused
# kernels, NCCL, copies; what the optimizer step launched; the longest kernels; where the GPU sat
# idle and where the host synchronised). The trace itself is kept gzipped beside the breakdown.
#   bash benchmarks/step_profile.sh                       # hymo_750m, one microbatch per step
#   CONFIG=train_configs/hymo_small.toml bash benchmarks/step_profile.sh
#   bash benchmarks/step_profile.sh --training.local_batch_size 16   # a bigger microbatch
#
# Environment: CONFIG (default train_configs/hymo_750m.toml), STEPS (default 8: steps 1-4 take
# the compiles, 5-7 warm the profiler, step STEPS is traced), GLOBAL_BATCH (default: the local
# batch, from --training.local_batch_size or the config, so one microbatch per step; "config"
# keeps the config's global batch), RUN_TIMEOUT (seconds, default 400), CUDA_ONLY=1 (trace the
# GPU's activity alone, benchmarks/cuda_only_train.py: the step at its own pace, its idle where
# it really is, but no host events to charge it to). Extra arguments go to run_train.sh. No
# checkpoints.
# For a bare GPU machine (scripts/gpu_env.sh): carry .whl/, data/brown/ and assets/tokenizer/;
# results under $OUT when set, else outputs/step_profile. DRY=1 runs the same logic on the CPU
# with the debug config, up to the trace (a CPU trace has no GPU kernels to break down).
set -euo pipefail
cd "$(dirname "$0")/.."

SITE=${SITE:-/tmp/site}
RESULTS=${OUT:-outputs/step_profile}
RUN_DIR=${RUN_DIR:-outputs/step_profile_run}
RUN_TIMEOUT=${RUN_TIMEOUT:-400}
if [ "${DRY:-0}" = 1 ]; then
    CONFIG=${CONFIG:-train_configs/debug_model.toml} STEPS=${STEPS:-5}
    EXTRA=(--validation.no-enable)
else
    CONFIG=${CONFIG:-train_configs/hymo_750m.toml} STEPS=${STEPS:-8}
    EXTRA=()
fi
[[ "${STEPS}" =~ ^[0-9]+$ ]] && [ "${STEPS}" -ge 5 ] || { echo "step_profile: STEPS must be an integer >= 5" >&2; exit 2; }
[ -f "${CONFIG}" ] || { echo "step_profile: no config ${CONFIG}" >&2; exit 2; }
if [ "${CUDA_ONLY:-0}" = 1 ]; then
    [ "${DRY:-0}" != 1 ] || { echo "step_profile: CUDA_ONLY=1 traces the GPU alone; DRY=1 runs on the CPU" >&2; exit 2; }
    export TRAIN_FILE=benchmarks.cuda_only_train
fi
NAME=step_profile . scripts/gpu_env.sh
if [ "${DRY:-0}" != 1 ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
python3 -c "import torch, triton, torchtitan; print('torch', torch.__version__, '| triton', triton.__version__, '| torchtitan', torchtitan.__version__)"

BATCH=()
if [ "${GLOBAL_BATCH:-}" != config ]; then
    # the local batch: from the arguments if they set it, else the config's (TorchTitan's default 8)
    local_batch=$(python3 -c "import sys, tomllib; print(tomllib.load(open(sys.argv[1], 'rb')).get('training', {}).get('local_batch_size', 8))" "${CONFIG}")
    args=("$@")
    for i in "${!args[@]}"; do
        case "${args[$i]}" in
            --training.local_batch_size) local_batch=${args[$((i + 1))]:-${local_batch}} ;;
            --training.local_batch_size=*) local_batch=${args[$i]#*=} ;;
        esac
    done
    BATCH=(--training.global_batch_size "${GLOBAL_BATCH:-${local_batch}}")
fi
mkdir -p "${RESULTS}"
label=$(basename "${CONFIG}" .toml)
rm -rf "${RUN_DIR:?}/${label}"
set +e
NGPU=1 LOG_RANK=0 CONFIG_FILE="${CONFIG}" timeout "${RUN_TIMEOUT}" ./run_train.sh \
    --training.steps "${STEPS}" --metrics.log_freq 1 --checkpoint.no-enable --job.dump_folder "${RUN_DIR}/${label}" \
    --profiling.enable_profiling --profiling.profile_freq "${STEPS}" --profiling.profiler_warmup 3 \
    --profiling.profiler_active 1 ${BATCH[@]+"${BATCH[@]}"} ${EXTRA[@]+"${EXTRA[@]}"} "$@" \
    > "${RESULTS}/${label}.log" 2>&1
rc=$?
set -e
grep -E "step: *[0-9]+ " "${RESULTS}/${label}.log" | tail -3 || true
if [ "${rc}" != 0 ]; then
    echo "step_profile: run_train.sh exited ${rc}; the last lines of ${RESULTS}/${label}.log:" >&2
    tail -20 "${RESULTS}/${label}.log" >&2
    exit "${rc}"
fi
trace=$(ls "${RUN_DIR}/${label}"/profile_traces/iteration_"${STEPS}"/rank0_trace.json 2>/dev/null || true)
[ -n "${trace}" ] || { echo "step_profile: no trace of step ${STEPS} under ${RUN_DIR}/${label}/profile_traces" >&2; exit 1; }
echo "# ${label}, step ${STEPS} ($(du -h "${trace}" | cut -f1) trace: ${trace})"
[ "${DRY:-0}" = 1 ] && exit 0
python3 -m benchmarks.trace_breakdown --idle "${trace}" > "${RESULTS}/${label}_breakdown.md"
gzip -c "${trace}" > "${RESULTS}/${label}_trace.json.gz"
cat "${RESULTS}/${label}_breakdown.md"
