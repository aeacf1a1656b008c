# Sourced by the GPU scripts (scripts/gpu_*.sh, benchmarks/*.sh): makes a bare GPU machine that
# has only the repository copy (no install, no network) able to run HyMo. Needs the gitignored
# inputs carried along: data/brown/ and assets/tokenizer/ (python -m hymo_recipes.data.prepare,
# on a machine with npm) and .whl/, the wheels the GPU image lacks: TorchTitan 0.2.2 and its
# own needs, datasets (TorchTitan's validator imports it) and, for the GDN benchmark's peer,
# flash-linear-attention. To make .whl/ on a machine with pip (the image's Python is 3.12):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       -d .whl torchtitan==0.2.2 torchdata==0.11.0 tyro==1.0.17 typeguard==4.6.1 \
#       docstring_parser==0.18.0 tomli==2.5.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
#       fla-core==0.6.0 flash-linear-attention==0.6.0
# Usage: NAME=<script name> SITE=<dir> . scripts/gpu_env.sh
for f in data/brown/train.parquet assets/tokenizer/tokenizer.json; do
    [ -f "$f" ] || { echo "${NAME}: missing $f; carry data/brown and assets/tokenizer" >&2; exit 1; }
done
# The carried wheels into SITE, kernels/ linked under its import name hymo_kernels (pip's
# editable install maps it), the repository itself on the path.
if ! python3 -c "import torchtitan, datasets" 2>/dev/null; then
    ls .whl/*.whl >/dev/null || { echo "${NAME}: no torchtitan or datasets, and no .whl/ to install them from" >&2; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "${SITE}" .whl/*.whl
fi
if ! python3 -c "import hymo_kernels" 2>/dev/null; then
    mkdir -p "${SITE}"
    ln -sfn "${PWD}/kernels" "${SITE}/hymo_kernels"
fi
export PYTHONPATH="${SITE}:${PWD}${PYTHONPATH:+:${PYTHONPATH}}"
