#!/usr/bin/env bash
# Two settings of one training config over several seeds, then one table
# (benchmarks/optim_compare_table.py): every run's final loss, main CE, tokens/s, optimizer
# share, skipped steps and MoE load, the mean per setting and the per-seed differences (B minus
# A). For choices one seed cannot settle (seed-to-seed spread of the final loss: benchmarks/
# HISTORY.md), e.g. the GDN kernel's T dots in bf16:
#   A_NAME=bf16 A_ARGS="--hymo.gdn_dot_precision bf16" \
#   B_NAME=bf16_t B_ARGS="--hymo.gdn_dot_precision bf16_t" bash benchmarks/ab_seeds.sh --training.seq_len 2048
#
# Environment: A_ARGS, B_ARGS (extra run_train.sh arguments of each setting; either may be
# empty), A_ENV, B_ENV (extra environment of each setting's runs, VAR=value words, e.g. a
# PYTHONPATH that puts a patched launch table first; a PYTHONPATH given there replaces the one
# scripts/gpu_env.sh sets, so name the site folder and the repository in it too), A_TREE,
# B_TREE (another copy of the repository whose code runs that setting, e.g. an earlier revision
# for a numerics check: `git archive REV | tar -x -C DIR`, made where the history is; its runs
# start its own run_train.sh from inside it with its hymo_recipes and kernels first on the path,
# its config files, this copy's data/brown and assets/tokenizer linked in; a relative path, like
# OUT and RUN_DIR, is taken from the repository's root), A_NAME,
# B_NAME (labels, default A and B: letters, digits, _ . -), SEEDS (default "1 2 3 4"), CONFIG
# (default train_configs/hymo_small.toml), STEPS (default 200), RUN_TIMEOUT (seconds per run,
# default 240). With the default config on the GPU every run takes 4 sequences per GPU and step
# (as the history's comparisons did; a --training.local_batch_size after the script's name
# overrides it). Extra arguments go to every run. Every run: --debug.seed SEED, every step
# logged, no checkpoints. On two GPUs A runs on GPU 0 and B on GPU 1, seed by seed side by side
# (four seeds of 200-step hymo_small runs fit one 10-minute call that way); on one GPU (or CPU)
# one after the other, or with SIDE_BY_SIDE=1 side by side on that one device, or with
# SIDE_BY_SIDE=all every seed's two runs at once on it (a short run's wall time is mostly its
# compile, which then overlaps; mind the device's memory). Both for the losses only: the runs
# share the device, so their tokens/s mean nothing.
#
# For a bare GPU machine (scripts/gpu_env.sh): carry .whl/, data/brown/ and assets/tokenizer/;
# results under $OUT when set, else outputs/ab_seeds. PACK=1 leaves two files there, table.txt
# and runs.tar.gz (every log and tensorboard folder), for a transfer that brings back only a
# few files (four seeds make 17). DRY=1 runs the same logic on CPU with the debug config
# (4 steps, seeds "1 2", A_ARGS/B_ARGS as given).
set -euo pipefail
cd "$(dirname "$0")/.."

SITE=${SITE:-/tmp/site}
RESULTS=${OUT:-outputs/ab_seeds}
RUN_DIR=${RUN_DIR:-outputs/ab_seeds_run}
RUN_TIMEOUT=${RUN_TIMEOUT:-240}
A_NAME=${A_NAME:-A}
B_NAME=${B_NAME:-B}
read -r -a A_EXTRA <<< "${A_ARGS:-}"
read -r -a B_EXTRA <<< "${B_ARGS:-}"
read -r -a A_ENVV <<< "${A_ENV:-}"
read -r -a B_ENVV <<< "${B_ENV:-}"
for word in ${A_ENVV[@]+"${A_ENVV[@]}"} ${B_ENVV[@]+"${B_ENVV[@]}"}; do
    [[ "${word}" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || { echo "ab_seeds: A_ENV/B_ENV word '${word}' is not VAR=value" >&2; exit 2; }
done
if [ "${DRY:-0}" = 1 ]; then
    CONFIG=${CONFIG:-train_configs/debug_model.toml} STEPS=${STEPS:-4} SEEDS=${SEEDS:-1 2}
    EXTRA=(--validation.no-enable)
else
    EXTRA=()
    if [ -z "${CONFIG:-}" ]; then
        # the seed checks' batch: 4 sequences a step, as every 200-step comparison in HISTORY.md
        # ran (hymo_small.toml's own batch, 32, is its throughput setting); a global batch of -1
        # is one microbatch per step, so a later --training.local_batch_size alone overrides it
        EXTRA=(--training.local_batch_size 4 --training.global_batch_size -1)
    fi
    CONFIG=${CONFIG:-train_configs/hymo_small.toml} STEPS=${STEPS:-200} SEEDS=${SEEDS:-1 2 3 4}
fi
for name in "${A_NAME}" "${B_NAME}"; do  # labels become file names (logs, run folders)
    [[ "${name}" =~ ^[A-Za-z0-9_.-]+$ ]] || { echo "ab_seeds: bad label '${name}': use letters, digits, _ . -" >&2; exit 2; }
done
case "${SIDE_BY_SIDE:-0}" in 0 | 1 | all) ;; *) echo "ab_seeds: SIDE_BY_SIDE is 0, 1 or all, not '${SIDE_BY_SIDE}'" >&2; exit 2 ;; esac
[ "${A_NAME}" != "${B_NAME}" ] || { echo "ab_seeds: A_NAME and B_NAME are both '${A_NAME}'" >&2; exit 2; }
TREES=()
for tree in "${A_TREE:-}" "${B_TREE:-}"; do
    if [ -n "${tree}" ] && [ ! -x "${tree}/run_train.sh" ]; then
        echo "ab_seeds: A_TREE/B_TREE '${tree}' has no run_train.sh: give a copy of the repository" >&2; exit 2
    fi
    if [ -n "${tree}" ]; then TREES+=("$(cd "${tree}" && pwd)"); else TREES+=(""); fi
done
mkdir -p "${RESULTS}"
RESULTS=$(cd "${RESULTS}" && pwd)
mkdir -p "${RUN_DIR}"
RUN_DIR=$(cd "${RUN_DIR}" && pwd)

NAME=ab_seeds . scripts/gpu_env.sh
if [ "${DRY:-0}" != 1 ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
python3 -c "import torch, triton, torchtitan; print('torch', torch.__version__, '| triton', triton.__version__, '| torchtitan', torchtitan.__version__)"

# A tree's runs: its kernels under their import name in a site folder of their own, that folder
# and the tree ahead of this copy on the path, this copy's data and tokenizer linked in.
tree_env() {  # tree_env TREE NAME: prints the PYTHONPATH of TREE's runs (runs in $(...): errexit set here)
    set -e
    local tree=$1 site="${RUN_DIR}/.sites/$2"
    mkdir -p "${site}" "${tree}/data" "${tree}/assets"
    ln -sfn "${tree}/kernels" "${site}/hymo_kernels"
    [ -e "${tree}/data/brown" ] || ln -sfn "${PWD}/data/brown" "${tree}/data/brown"
    [ -e "${tree}/assets/tokenizer" ] || ln -sfn "${PWD}/assets/tokenizer" "${tree}/assets/tokenizer"
    [ -f "${site}/hymo_kernels/__init__.py" ] || { echo "ab_seeds: ${tree} has no kernels/ package" >&2; exit 1; }
    echo "${site}:${tree}:${PYTHONPATH}"
}
TREE_PATHS=("" "")
for i in 0 1; do
    if [ -n "${TREES[$i]}" ]; then
        TREE_PATHS[$i]=$(tree_env "${TREES[$i]}" "$([ "$i" = 0 ] && echo "${A_NAME}" || echo "${B_NAME}")") || {
            echo "ab_seeds: could not set up the tree ${TREES[$i]}" >&2; exit 2; }
    fi
done

status=0
run() {  # run LABEL GPU SEED [overrides...]; LABEL names the log and the run folder; RUN_ENV its
    # environment, RUN_TREE the copy of the repository it runs from (empty: this one), RUN_PATH its PYTHONPATH
    local label=$1 gpu=$2 seed=$3; shift 3
    rm -rf "${RUN_DIR:?}/${label}"
    local start=$SECONDS
    set +e
    (
        if [ -n "${RUN_TREE}" ]; then
            cd "${RUN_TREE}" || exit 2
            export PYTHONPATH="${RUN_PATH}"
        fi
        env ${RUN_ENV[@]+"${RUN_ENV[@]}"} CUDA_VISIBLE_DEVICES=${gpu} NGPU=1 LOG_RANK=0 CONFIG_FILE="${CONFIG}" \
            timeout "${RUN_TIMEOUT}" ./run_train.sh --training.steps "${STEPS}" --metrics.log_freq 1 \
            --debug.seed "${seed}" --checkpoint.no-enable --job.dump_folder "${RUN_DIR}/${label}" \
            ${EXTRA[@]+"${EXTRA[@]}"} "$@" > "${RESULTS}/${label}.log" 2>&1
    )
    local rc=$?
    set -e
    echo "${label}: exit ${rc}, $((SECONDS - start)) s wall"
    if [ "${rc}" -ne 0 ]; then
        tail -n 30 "${RESULTS}/${label}.log" | sed -E 's/\x1b\[[0-9;]*m//g'
    fi
    cp -r "${RUN_DIR}/${label}/tb" "${RESULTS}/tb_${label}" 2>/dev/null || true
    return "${rc}"
}

two_gpus=0 gpu_b=1
if [ "${SIDE_BY_SIDE:-0}" = all ]; then
    echo "ab_seeds: SIDE_BY_SIDE=all: every seed's A and B at once on one device; their tokens/s say nothing"
elif [ "${DRY:-0}" != 1 ] && [ "$(nvidia-smi --list-gpus | wc -l)" -ge 2 ]; then
    two_gpus=1
elif [ "${SIDE_BY_SIDE:-0}" = 1 ]; then
    two_gpus=1 gpu_b=0
    echo "ab_seeds: SIDE_BY_SIDE=1: A and B of each seed share one device; their tokens/s say nothing"
fi
labels=() pids=()
for seed in ${SEEDS}; do
    a="${A_NAME}_s${seed}" b="${B_NAME}_s${seed}"
    if [ "${SIDE_BY_SIDE:-0}" = all ]; then
        RUN_ENV=(${A_ENVV[@]+"${A_ENVV[@]}"}) RUN_TREE=${TREES[0]} RUN_PATH=${TREE_PATHS[0]}
        one=${CUDA_VISIBLE_DEVICES:-0}
        one=${one%%,*}  # the first visible device: every run on it
        run "${a}" "${one}" "${seed}" ${A_EXTRA[@]+"${A_EXTRA[@]}"} "$@" & pids+=($!)
        RUN_ENV=(${B_ENVV[@]+"${B_ENVV[@]}"}) RUN_TREE=${TREES[1]} RUN_PATH=${TREE_PATHS[1]}
        run "${b}" "${one}" "${seed}" ${B_EXTRA[@]+"${B_EXTRA[@]}"} "$@" & pids+=($!)
    elif [ "${two_gpus}" = 1 ]; then
        RUN_ENV=(${A_ENVV[@]+"${A_ENVV[@]}"}) RUN_TREE=${TREES[0]} RUN_PATH=${TREE_PATHS[0]}
        run "${a}" 0 "${seed}" ${A_EXTRA[@]+"${A_EXTRA[@]}"} "$@" & pid=$!
        RUN_ENV=(${B_ENVV[@]+"${B_ENVV[@]}"}) RUN_TREE=${TREES[1]} RUN_PATH=${TREE_PATHS[1]}
        run "${b}" "${gpu_b}" "${seed}" ${B_EXTRA[@]+"${B_EXTRA[@]}"} "$@" || status=$?
        wait "${pid}" || status=$?
    else
        RUN_ENV=(${A_ENVV[@]+"${A_ENVV[@]}"}) RUN_TREE=${TREES[0]} RUN_PATH=${TREE_PATHS[0]}
        run "${a}" "${CUDA_VISIBLE_DEVICES:-0}" "${seed}" ${A_EXTRA[@]+"${A_EXTRA[@]}"} "$@" || status=$?
        RUN_ENV=(${B_ENVV[@]+"${B_ENVV[@]}"}) RUN_TREE=${TREES[1]} RUN_PATH=${TREE_PATHS[1]}
        run "${b}" "${CUDA_VISIBLE_DEVICES:-0}" "${seed}" ${B_EXTRA[@]+"${B_EXTRA[@]}"} "$@" || status=$?
    fi
    labels+=("${A_NAME}@${seed}=${RUN_DIR}/${a}" "${B_NAME}@${seed}=${RUN_DIR}/${b}")
done
for pid in ${pids[@]+"${pids[@]}"}; do
    wait "${pid}" || status=$?
done

echo "================ ab_seeds: ${CONFIG}, ${STEPS} steps, seeds ${SEEDS} ================"
echo "${A_NAME}: ${A_ARGS:-(no extra arguments)}${A_ENV:+ | environment ${A_ENV}}${A_TREE:+ | tree ${A_TREE}}"
echo "${B_NAME}: ${B_ARGS:-(no extra arguments)}${B_ENV:+ | environment ${B_ENV}}${B_TREE:+ | tree ${B_TREE}}"
python3 -m benchmarks.optim_compare_table "${labels[@]}" | tee "${RESULTS}/table.txt" || status=1
if [ "${PACK:-0}" = 1 ]; then
    packed=()
    for f in "${RESULTS}"/*; do
        case "$(basename "$f")" in table.txt | runs.tar.gz) ;; *) packed+=("$(basename "$f")") ;; esac
    done
    if [ "${#packed[@]}" -gt 0 ]; then
        tar -czf "${RESULTS}/runs.tar.gz" -C "${RESULTS}" "${packed[@]}" && (cd "${RESULTS}" && rm -rf "${packed[@]}")
    fi
fi
exit "${status}"
