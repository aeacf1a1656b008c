# Sourced by the scripts/gpu_*.sh scripts: makes a bare GPU machine that has only the repository
# copy (no install, no network) able to run HyMo. Needs the gitignored inputs carried along:
# .whl/ (TorchTitan 0.2.2 and the wheels it needs that the image lacks), data/brown/ and
# assets/tokenizer/ (python -m hymo_recipes.data.prepare, on a machine with npm).
# Usage: NAME=<script name> SITE=<dir> . scripts/gpu_env.sh
for f in data/brown/train.parquet assets/tokenizer/tokenizer.json; do
    [ -f "$f" ] || { echo "${NAME}: missing $f; carry data/brown and assets/tokenizer" >&2; exit 1; }
done
# TorchTitan from the carried wheels, kernels/ linked under its import name hymo_kernels (pip's
# editable install maps it), the repository itself on the path.
if ! python3 -c "import torchtitan" 2>/dev/null; then
    ls .whl/*.whl >/dev/null || { echo "${NAME}: no torchtitan and no .whl/ to install it from" >&2; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "${SITE}" .whl/*.whl
fi
if ! python3 -c "import hymo_kernels" 2>/dev/null; then
    mkdir -p "${SITE}"
    ln -sfn "${PWD}/kernels" "${SITE}/hymo_kernels"
fi
export PYTHONPATH="${SITE}:${PWD}${PYTHONPATH:+:${PYTHONPATH}}"
