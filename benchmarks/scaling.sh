#!/usr/bin/env bash
# FSDP2 weak scaling and checkpoint resume across world sizes, in one call of at most ~9
# minutes on a machine of 2 (or 4) GPUs. Runs, through run_train.sh, with the 750m config
# (bf16 parameters, fp32 reduction, per-block torch.compile, selective AC, Triton GDN kernel,
# NorMuon + CautiousAdamW, seq_len 4096):
#
# 1. scale_<S>gpu: S = SAVE_NGPU (2) GPUs, SAVE_STEP + CONT_STEPS steps (20 + 10), a full
#    checkpoint (model, both optimizers, schedulers, data position, MoE state) at SAVE_STEP.
#    Its tokens/s is the S-GPU scaling point; its losses after SAVE_STEP are the uninterrupted
#    reference for the resumes.
# 2. scale_<n>gpu for the other n of NGPUS ("1 2"; "1 2 4" where 4 GPUs are lent): SAVE_STEP
#    steps each, no checkpoint.
# 3. resume_<S>to<n>gpu for n in RESUME_NGPUS (NGPUS without S): the step-SAVE_STEP checkpoint
#    (linked, not copied) resumed on n GPUs to SAVE_STEP + CONT_STEPS with the SAME global batch
#    as the S-GPU run (local batch min(LOCAL_BATCH, global / n), the rest as gradient
#    accumulation: on 1 GPU 2 microbatches of 4).
# Weak scaling: every scaling run has LOCAL_BATCH (4) sequences of 4096 tokens per GPU and
# global batch = LOCAL_BATCH x n, so no run accumulates gradients; the config's own global batch
# (128, accumulation over 4 microbatches on 8 GPUs) is not used, as it would put a different
# number of microbatches behind each optimizer step at each n. The lr schedule is pinned to the
# config's 57,220 steps (--lr_scheduler.total_steps, LR_TOTAL_STEPS), so every run has the
# same lr at every step (steps 1-30 are in its 1,144-step warmup).
#
# The table (benchmarks/scaling_table.py), printed last: per n, tokens/s per GPU (TorchTitan's
# tps, mean over steps WARMUP+1..SAVE_STEP), scaling efficiency (that over the 1-GPU value),
# step time, the optimizer container's step time and share (NorMuon + CautiousAdamW, NaN check
# included), peak memory, time to the first step; per resume, the losses of steps
# SAVE_STEP+1..SAVE_STEP+CONT_STEPS against the reference (max |dloss|, relative). A resume on
# another number of GPUs does NOT see the reference's batches: the epoch continues on the
# documents no rank has read, split over the new ranks (hymo_recipes/titan/dataloader.py), so
# the losses differ by batch-to-batch noise, not only by bf16 reduction order; the table's
# tolerance says which case applies, and its trend check catches a resume that re-reads
# trained-on data.
#
# Budget: every run is cut by `timeout` at what is left of DEADLINE_S (510 s from the start of
# this script, setup included) minus a reserve for the table, so the script always ends and
# prints what it has; a run that no longer fits is skipped and the table says so. Timestamps
# ("[+SSSs]") mark every phase. The inductor/Triton compile cache (COMPILE_CACHE) is shared by
# all runs, so only the first compiles from scratch. Runs start through a small wrapper of
# run_train.sh's training module that flushes the tensorboard events at every logged step (TorchTitan's
# writer buffers them until the end, and a run cut by `timeout` would lose them); the table
# also reads the console logs, which survive a cut.
#
# Machine: a bare GPU machine (scripts/gpu_env.sh); carry [".whl", "data/brown",
# "assets/tokenizer"], kind nvidia-h200-x2, command "bash benchmarks/scaling.sh" (on
# nvidia-h200-x4: "NGPUS='1 2 4' bash benchmarks/scaling.sh").
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
# NVSHMEM_DISABLE_NVLS=1, as the x2/x4 machines require).
# Under $OUT (else outputs/scaling): one log per run (ANSI codes stripped), summary.txt
# (phases and table), scalars.json (every run's tensorboard scalars): at most 7 files.
# Checkpoints and tensorboard folders stay in RUN_DIR (outputs/scaling_run), outside $OUT.
#
# DRY=1: the same logic on CPU with train_configs/debug_model.toml (1 and 2 processes, FSDP2
# over gloo, fp32, no compile), save at step 4, resume to 6; about 1.5 minutes on 2 idle cores.
# CONFIG_BATCH_STEPS=N (default 0: skipped) adds a run on SAVE_NGPU GPUs with the config's own
# batch (750m: global 128 of local 4, i.e. 16 microbatches per step on 2 GPUs), N steps, whose
# table row gives the optimizer's and NorMuon's share of a training step as configured.
# Extra arguments go to every run (e.g. --optimizer.name AdamW).
set -euo pipefail
cd "$(dirname "$0")/.."
T0=$SECONDS

SITE=${SITE:-/tmp/site}
RESULTS=${OUT:-outputs/scaling}
RUN_DIR=${RUN_DIR:-outputs/scaling_run}
NGPUS=${NGPUS:-"1 2"}
SAVE_NGPU=${SAVE_NGPU:-2}
RESUME_NGPUS=${RESUME_NGPUS-$(for n in ${NGPUS}; do [ "$n" = "${SAVE_NGPU}" ] || printf '%s ' "$n"
                               done)}
LOCAL_BATCH=${LOCAL_BATCH:-4}
if [ "${DRY:-0}" = 1 ]; then
    CONFIG=train_configs/debug_model.toml
    WARMUP=${WARMUP:-2} SAVE_STEP=${SAVE_STEP:-4} CONT_STEPS=${CONT_STEPS:-2}
    LR_TOTAL_STEPS=${LR_TOTAL_STEPS:-60}
    DEADLINE_S=${DEADLINE_S:-300} MIN_RUN_S=${MIN_RUN_S:-20} RESERVE_S=${RESERVE_S:-15}
    EXTRA=(--validation.no-enable)
else
    CONFIG=train_configs/hymo_750m.toml
    WARMUP=${WARMUP:-5} SAVE_STEP=${SAVE_STEP:-20} CONT_STEPS=${CONT_STEPS:-10}
    LR_TOTAL_STEPS=${LR_TOTAL_STEPS:-57220}
    DEADLINE_S=${DEADLINE_S:-510} MIN_RUN_S=${MIN_RUN_S:-60} RESERVE_S=${RESERVE_S:-20}
    EXTRA=()
fi
RUN_TIMEOUT=${RUN_TIMEOUT:-600}  # cap per run, below what is left of DEADLINE_S
END_STEP=$((SAVE_STEP + CONT_STEPS))
mkdir -p "${RESULTS}" "${RUN_DIR}"
PHASES="${RUN_DIR}/phases.txt"
: > "${PHASES}"
stamp() { echo "[+$(printf '%3d' $((SECONDS - T0)))s $(date +%T)] $*" | tee -a "${PHASES}"; }

# NVLink multicast off in NCCL, PyTorch and NVSHMEM (KINDS.md: the x2/x4/x8 machines), also
# for every process torchrun starts (they inherit this environment).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# One compile cache for all runs: the later runs load the blocks the first one compiled.
COMPILE_CACHE=${COMPILE_CACHE:-/tmp/hymo_scaling_compile_cache}
export TORCHINDUCTOR_CACHE_DIR="${COMPILE_CACHE}" TRITON_CACHE_DIR="${COMPILE_CACHE}/triton"
export TORCHINDUCTOR_FX_GRAPH_CACHE=1 TORCHINDUCTOR_AUTOGRAD_CACHE=1

stamp "setup: ${CONFIG}; NGPUS='${NGPUS}', save on ${SAVE_NGPU} at step ${SAVE_STEP}," \
      "continue to ${END_STEP}, resume on '${RESUME_NGPUS}'; deadline ${DEADLINE_S} s"
NAME=scaling . scripts/gpu_env.sh

# The training entry point run_train.sh starts (its TRAIN_FILE default), with the tensorboard
# events flushed at every logged step.
HYMO_TRAIN_MODULE=$(sed -n 's/^TRAIN_FILE=${TRAIN_FILE:-"\([A-Za-z0-9_.]*\)"}$/\1/p' run_train.sh)
[ -n "${HYMO_TRAIN_MODULE}" ] || { echo "scaling: no TRAIN_FILE default found in run_train.sh" >&2; exit 1; }
export HYMO_TRAIN_MODULE
WRAP_DIR=$(mktemp -d)
cat > "${WRAP_DIR}/hymo_scaling_train.py" <<'PYEOF'
import importlib
import os

# HyMo's entry module first: it must be imported before torchtitan (on a CPU machine it sets
# the device type torchtitan picks at import)
train = importlib.import_module(os.environ["HYMO_TRAIN_MODULE"])
from torchtitan.components import metrics  # noqa: E402

_log = metrics.TensorBoardLogger.log


def _log_and_flush(self, values, step):
    _log(self, values, step)
    self.writer.flush()


metrics.TensorBoardLogger.log = _log_and_flush
train.main()
PYEOF
export PYTHONPATH="${WRAP_DIR}:${PYTHONPATH}"

if [ "${DRY:-0}" = 1 ]; then
    AVAILABLE=64  # CPU processes
else
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    nvidia-smi topo -m 2>/dev/null | head -n 8 || true
    AVAILABLE=$(python3 -c "import torch; print(torch.cuda.device_count())")
fi
python3 -c "import torch, triton, torchtitan; print('torch', torch.__version__, '| triton',
triton.__version__, '| torchtitan', torchtitan.__version__, '| devices', torch.cuda.device_count())"
for v in NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS \
         TORCHINDUCTOR_CACHE_DIR; do
    printf '%s=%s ' "${v}" "${!v}"
done
echo
stamp "setup done (${AVAILABLE} devices)"

COMMON=(--metrics.log_freq 1 --debug.seed 42 --lr_scheduler.total_steps "${LR_TOTAL_STEPS}"
        ${EXTRA[@]+"${EXTRA[@]}"})
status=0
TABLE_ARGS=()

run() {  # run NAME NPROC [overrides...]: one run_train.sh, cut at what is left of the deadline
    # (LINK_CKPT=<step folder>: linked into the run's checkpoint folder first, to resume from)
    local name=$1 n=$2; shift 2
    local left=$((DEADLINE_S - RESERVE_S - (SECONDS - T0)))
    local limit=$((left < RUN_TIMEOUT ? left : RUN_TIMEOUT))
    rm -rf "${RUN_DIR:?}/${name}"
    if [ "${n}" -gt "${AVAILABLE}" ]; then
        stamp "skip ${name}: needs ${n} devices, ${AVAILABLE} here"
        return 0
    fi
    if [ "${limit}" -lt "${MIN_RUN_S}" ]; then
        stamp "skip ${name}: ${left} s left before the deadline, under MIN_RUN_S=${MIN_RUN_S}"
        return 0
    fi
    mkdir -p "${RUN_DIR}/${name}/checkpoint"
    if [ -n "${LINK_CKPT:-}" ]; then
        ln -s "$(cd "${LINK_CKPT}" && pwd)" \
            "${RUN_DIR}/${name}/checkpoint/$(basename "${LINK_CKPT}")"
    fi
    stamp "start ${name}: ${n} process(es), cut at ${limit} s"
    local start=$SECONDS rc
    set +e
    NGPU=${n} LOG_RANK=0 CONFIG_FILE="${CONFIG}" TRAIN_FILE=hymo_scaling_train \
        timeout -k 20 "${limit}" ./run_train.sh --job.dump_folder "${RUN_DIR}/${name}" \
        "${COMMON[@]}" "$@" 2>&1 \
        | sed -u -E 's/\x1b\[[0-9;]*[A-Za-z]//g' > "${RESULTS}/${name}.log"
    rc=${PIPESTATUS[0]}
    set -e
    stamp "end ${name}: exit ${rc}$([ "${rc}" = 124 ] && echo ' (cut by timeout)')," \
          "$((SECONDS - start)) s wall"
    if [ "${rc}" -ne 0 ]; then
        status=${rc}
        grep -v '^\s*\(File\|\^\|return\|result =\)' "${RESULTS}/${name}.log" | tail -n 15
    fi
    # torchrun starts its workers with setsid, out of reach of timeout's process-group
    # signal; it stops them itself when signalled, unless the SIGKILL came first. Any worker of
    # this run still alive (its unique dump folder on the command line) is ended here.
    local left_over
    left_over=$(pgrep -f -- "--job.dump_folder ${RUN_DIR}/${name} " || true)
    if [ -n "${left_over}" ]; then
        stamp "ending left-over processes of ${name}: $(echo ${left_over})"
        kill -9 ${left_over} 2>/dev/null || true
        sleep 3
    fi
}

# 1. S GPUs: scaling point, checkpoint at SAVE_STEP, uninterrupted reference to END_STEP. The
#    last save (END_STEP) is model-only, to keep its write short.
SAVE_RUN=scale_${SAVE_NGPU}gpu
run "${SAVE_RUN}" "${SAVE_NGPU}" --training.steps "${END_STEP}" \
    --training.local_batch_size "${LOCAL_BATCH}" \
    --training.global_batch_size $((LOCAL_BATCH * SAVE_NGPU)) \
    --checkpoint.enable --checkpoint.interval "${SAVE_STEP}" --checkpoint.last_save_model_only "$@"
TABLE_ARGS+=(--scale "${SAVE_NGPU}" "${RUN_DIR}/${SAVE_RUN}" "${RESULTS}/${SAVE_RUN}.log")

# 2. The other scaling points, SAVE_STEP steps each.
for n in ${NGPUS}; do
    [ "${n}" = "${SAVE_NGPU}" ] && continue
    run "scale_${n}gpu" "${n}" --training.steps "${SAVE_STEP}" \
        --training.local_batch_size "${LOCAL_BATCH}" \
        --training.global_batch_size $((LOCAL_BATCH * n)) --checkpoint.no-enable "$@"
    TABLE_ARGS+=(--scale "${n}" "${RUN_DIR}/scale_${n}gpu" "${RESULTS}/scale_${n}gpu.log")
done

# 3. Resumes of the step-SAVE_STEP checkpoint on other GPU counts, same global batch; the
#    checkpoint is linked into the run's folder; load_only: the resumed run saves nothing.
SAVED="${RUN_DIR}/${SAVE_RUN}/checkpoint/step-${SAVE_STEP}"
GLOBAL=$((LOCAL_BATCH * SAVE_NGPU))
for n in ${RESUME_NGPUS}; do
    name=resume_${SAVE_NGPU}to${n}gpu
    TABLE_ARGS+=(--resume "${n}" "${RUN_DIR}/${name}" "${RESULTS}/${name}.log")
    local_batch=$((LOCAL_BATCH * n > GLOBAL ? GLOBAL / n : LOCAL_BATCH))
    if [ ! -f "${SAVED}/.metadata" ]; then
        rm -rf "${RUN_DIR:?}/${name}"
        stamp "skip ${name}: no complete checkpoint ${SAVED}"
    elif [ "${local_batch}" -lt 1 ] || [ $((GLOBAL % (local_batch * n))) -ne 0 ]; then
        rm -rf "${RUN_DIR:?}/${name}"
        stamp "skip ${name}: global batch ${GLOBAL} does not split over ${n} ranks"
    else
        LINK_CKPT="${SAVED}" run "${name}" "${n}" --training.steps "${END_STEP}" \
            --training.local_batch_size "${local_batch}" \
            --training.global_batch_size "${GLOBAL}" --checkpoint.enable --checkpoint.load_only "$@"
    fi
done

# 4. Optional: the config's own batch (global 128 of local 4: gradient accumulation) on S GPUs,
#    CONFIG_BATCH_STEPS steps, for the optimizer's share of a real training step.
if [ "${CONFIG_BATCH_STEPS:-0}" -gt 0 ]; then
    name=config_batch_${SAVE_NGPU}gpu
    run "${name}" "${SAVE_NGPU}" --training.steps "${CONFIG_BATCH_STEPS}" --checkpoint.no-enable "$@"
    TABLE_ARGS+=(--config-batch "${SAVE_NGPU}" "${RUN_DIR}/${name}" "${RESULTS}/${name}.log")
fi

stamp "runs done; table"
TABLE="${RUN_DIR}/table.txt"
if ! python3 -m benchmarks.scaling_table --config "${CONFIG}" --warmup "${WARMUP}" \
        --save-step "${SAVE_STEP}" --save-ngpu "${SAVE_NGPU}" --json "${RESULTS}/scalars.json" \
        ${TABLE_ARGS[@]+"${TABLE_ARGS[@]}"} > "${TABLE}" 2>&1; then
    status=1
fi
stamp "end (exit ${status})"
cat "${PHASES}" "${TABLE}" > "${RESULTS}/summary.txt"
echo "================ scaling: ${CONFIG}$([ "${DRY:-0}" = 1 ] && echo ' (DRY, CPU)')," \
     "$((SECONDS - T0)) s in all ================"
cat "${TABLE}"
rm -rf "${WRAP_DIR}"
exit "${status}"
