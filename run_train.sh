#!/usr/bin/env bash
# HyMo launcher, TorchTitan's run_train.sh with HyMo's defaults. Env overrides, e.g.
#   ./run_train.sh                                          # debug model; 2 CPU processes without a GPU
#   NGPU=1 CONFIG_FILE=train_configs/hymo_small.toml ./run_train.sh --training.steps 20
#   LOG_RANK=0,1 NGPU=8 CONFIG_FILE=train_configs/hymo_750m.toml ./run_train.sh
#   COMM_MODE=fake_backend ./run_train.sh                   # one process, config and model checks only
# NGPU is the number of processes: by default one per visible GPU, or 2 CPU processes when
# there is no GPU (FSDP2 over gloo). LOG_RANK: the ranks whose output is shown. TRAIN_FILE: the
# module torchrun runs. Arguments after the script override the TOML (--section.key value);
# ./run_train.sh --help lists these variables and HyMo's options.
set -euo pipefail

# --help: the variables above and HyMo's options, without starting anything
for arg in "$@"; do
    case "${arg}" in
        -h|--help) exec python3 "$(dirname "$0")/hymo_recipes/titan/help.py" ;;
    esac
done

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
if [ -n "${COMM_MODE}" ]; then
    # One process pretends to be NGPU ranks: validates the config, builds the model, runs a
    # step. No checkpoint: DCP cannot plan a save over fake collectives.
    NGPU="${NGPU}" LOCAL_RANK=0 python3 -m "${TRAIN_FILE}" --job.config_file "${CONFIG_FILE}" \
        "$@" --comm.mode="${COMM_MODE}" --training.steps=1 --checkpoint.no-enable
else
    # torchrun itself, minus its failure report after a config error the ranks already named
    PYTORCH_ALLOC_CONF="expandable_segments:True" \
    python3 "$(dirname "$0")/scripts/launch.py" --nproc_per_node="${NGPU}" \
        --rdzv_backend c10d --rdzv_endpoint="localhost:0" --local-ranks-filter "${LOG_RANK}" --role rank --tee 3 \
        -m "${TRAIN_FILE}" --job.config_file "${CONFIG_FILE}" "$@"
fi
