#!/usr/bin/env bash
# HyMo launcher, TorchTitan's run_train.sh with HyMo's defaults. Env overrides, e.g.
#   ./run_train.sh                                          # debug model; 2 CPU processes without a GPU
#   NGPU=1 CONFIG_FILE=train_configs/hymo_small.toml ./run_train.sh --training.steps 20
#   LOG_RANK=0,1 NGPU=8 CONFIG_FILE=train_configs/hymo_750m.toml ./run_train.sh
#   CHECK=1 NGPU=8 CONFIG_FILE=train_configs/hymo_750m.toml ./run_train.sh   # config check, any machine
#   COMM_MODE=fake_backend ./run_train.sh                   # one process, builds the model, one step
# NGPU is the number of processes: by default one per visible GPU, or 2 CPU processes when
# there is no GPU (FSDP2 over gloo). LOG_RANK: the ranks whose output is shown. TRAIN_FILE: the
# module torchrun runs. Arguments after the script override the TOML (--section.key value);
# ./run_train.sh --help lists these variables and HyMo's options.
# Several nodes: run the script once on every node, NGPU processes each (scripts/multinode_train.slurm
# does it under SLURM). NNODES (default 1) nodes; the rendezvous is either static, MASTER_ADDR
# (+ MASTER_PORT, default 29500) of node 0 with NODE_RANK (default 0) this node's rank, or c10d
# at RDZV_ENDPOINT=host[:port] (+ RDZV_ID, default hymo), which numbers the nodes itself:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 NGPU=8 CONFIG_FILE=... ./run_train.sh   # on node0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 MASTER_PORT=29500 NGPU=8 CONFIG_FILE=... ./run_train.sh   # on node1
#   NNODES=2 RDZV_ENDPOINT=node0:29400 RDZV_ID=job42 NGPU=8 CONFIG_FILE=... ./run_train.sh         # on each node
# Unset (NNODES=1): the single-node launch above, unchanged. With NNODES > 1, CHECK and
# COMM_MODE check NNODES x NGPU processes.
set -euo pipefail

# --help: the variables above and HyMo's options, without starting anything
for arg in "$@"; do
    case "${arg}" in
        -h|--help) exec python3 "$(dirname "$0")/hymo_recipes/titan/help.py" ;;
    esac
done

# The environment: python3 must import torch and hymo_recipes; else the repository's .venv is used
# when there is one (said in one line), else the run stops saying how to make one.
has_env() { "$1" -c 'import importlib.util as u, sys; sys.exit(not (u.find_spec("torch") and u.find_spec("hymo_recipes")))' 2>/dev/null; }
if ! has_env python3; then
    VENV="$(cd "$(dirname "$0")" && pwd)/.venv"
    if [ -x "${VENV}/bin/python3" ] && has_env "${VENV}/bin/python3"; then
        echo "run_train.sh: python3 ($(command -v python3 || echo none)) lacks torch or hymo_recipes; using ${VENV}" >&2
        export PATH="${VENV}/bin:${PATH}" VIRTUAL_ENV="${VENV}"
    else
        echo "run_train.sh: python3 ($(command -v python3 || echo none)) cannot import torch and hymo_recipes, and there is no usable .venv: run ./scripts/setup.sh, then . .venv/bin/activate" >&2
        exit 1
    fi
fi

if [ -z "${NGPU:-}" ]; then
    if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
        NGPU=$(echo "${CUDA_VISIBLE_DEVICES}" | tr ',' '\n' | grep -c .)
    else
        NGPU=$(nvidia-smi --list-gpus 2>/dev/null | wc -l || true)
    fi
    [ "${NGPU}" -gt 0 ] || NGPU=2
fi
export LOG_RANK=${LOG_RANK:-0}
CONFIG_FILE=${CONFIG_FILE:-"./train_configs/debug_model.toml"}
TRAIN_FILE=${TRAIN_FILE:-"hymo_recipes.train"}
COMM_MODE=${COMM_MODE:-""}

# Several nodes: bad values fail here, in one line, before torchrun starts (and waits for nodes
# that never come).
fail() { echo "run_train.sh: $*" >&2; exit 1; }
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
[[ "${NNODES}" =~ ^[1-9][0-9]*$ ]] || fail "NNODES=${NNODES} is not a positive integer (the number of nodes)"
[[ "${NODE_RANK}" =~ ^(0|[1-9][0-9]*)$ ]] || fail "NODE_RANK=${NODE_RANK} is not a non-negative integer (this node's rank)"
[ "${NODE_RANK}" -lt "${NNODES}" ] || fail "NODE_RANK=${NODE_RANK} must be below NNODES=${NNODES} (nodes 0 .. $((NNODES - 1)))"
if [ "${NNODES}" -eq 1 ]; then
    # one node: torchrun's own local rendezvous on a free port
    RDZV_ARGS=(--rdzv_backend c10d --rdzv_endpoint="localhost:0")
elif [ -n "${CHECK:-}" ] || [ -n "${COMM_MODE}" ]; then
    # no launch: the check and the fake-backend step see the whole job's process count
    [[ "${NGPU}" =~ ^[1-9][0-9]*$ ]] || fail "NGPU=${NGPU} is not a positive integer (processes per node)"
    NGPU=$((NNODES * NGPU))
elif [ -n "${RDZV_ENDPOINT:-}" ]; then
    # c10d: the agent on the endpoint's host serves the rendezvous and the nodes get their ranks
    # in the order it sorts them (torchrun ignores --node_rank here, so it is not passed)
    RDZV_ARGS=(--nnodes="${NNODES}" --rdzv_backend c10d --rdzv_endpoint="${RDZV_ENDPOINT}" --rdzv_id="${RDZV_ID:-hymo}")
elif [ -n "${MASTER_ADDR:-}" ]; then
    # static: node 0 serves the store at MASTER_ADDR:MASTER_PORT, every node says its rank
    MASTER_PORT=${MASTER_PORT:-29500}
    [[ "${MASTER_PORT}" =~ ^[1-9][0-9]*$ ]] && [ "${MASTER_PORT}" -le 65535 ] \
        || fail "MASTER_PORT=${MASTER_PORT} is not a port number (1-65535)"
    RDZV_ARGS=(--nnodes="${NNODES}" --node_rank="${NODE_RANK}" --rdzv_backend static
               --master_addr="${MASTER_ADDR}" --master_port="${MASTER_PORT}")
else
    fail "NNODES=${NNODES} needs a rendezvous all nodes reach: MASTER_ADDR (+ MASTER_PORT, NODE_RANK) of node 0, or RDZV_ENDPOINT=host:port"
fi

# A missing or malformed TOML fails here, in one line, not inside every rank's traceback.
# (Unknown keys need TorchTitan's config classes: the trainer reports those.)
python3 - "${CONFIG_FILE}" <<'PYEOF'
import sys
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
try:
    with open(sys.argv[1], "rb") as f:
        tomllib.load(f)
except (OSError, tomllib.TOMLDecodeError) as e:
    sys.exit(f"run_train.sh: cannot use CONFIG_FILE={sys.argv[1]}: {e}")
PYEOF

set -x
if [ -n "${CHECK:-}" ]; then
    # The config check: preflight, model on the meta device, optimizer partition, memory per GPU
    # at NGPU processes; no step, nothing written (hymo_recipes/titan/check.py)
    NGPU="${NGPU}" python3 -m hymo_recipes.titan.check --job.config_file "${CONFIG_FILE}" "$@"
elif [ -n "${COMM_MODE}" ]; then
    # One process pretends to be NGPU ranks: validates the config, builds the model, runs a
    # step. No checkpoint: DCP cannot plan a save over fake collectives.
    NGPU="${NGPU}" LOCAL_RANK=0 python3 -m "${TRAIN_FILE}" --job.config_file "${CONFIG_FILE}" \
        "$@" --comm.mode="${COMM_MODE}" --training.steps=1 --checkpoint.no-enable
else
    # torchrun itself, minus its failure report after a config error the ranks already named;
    # exec'd, so that a SIGTERM/SIGINT sent to this script reaches it (and a checkpoint is saved)
    export PYTORCH_ALLOC_CONF="expandable_segments:True"
    exec python3 "$(dirname "$0")/scripts/launch.py" --nproc_per_node="${NGPU}" \
        "${RDZV_ARGS[@]}" --local-ranks-filter "${LOG_RANK}" --role rank --tee 3 \
        -m "${TRAIN_FILE}" --job.config_file "${CONFIG_FILE}" "$@"
fi
