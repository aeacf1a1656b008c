#!/usr/bin/env bash
# The GPU-marked tests (pytest -m gpu: the kernel's parity against the references, the Inductor
# compile of a GDN block, ...) on a GPU machine, then a short pass/fail summary.
#   bash scripts/gpu_tests.sh                      # every GPU test
#   bash scripts/gpu_tests.sh -k "not compile"     # extra arguments go to pytest
#
# For a bare GPU machine with the repository copy but no HyMo install and no network
# (scripts/gpu_env.sh): carry .whl/, data/brown/ and assets/tokenizer/, e.g. the device tool with
# carry [".whl", "data/brown", "assets/tokenizer"] and command "bash scripts/gpu_tests.sh".
# The pytest log is $OUT/gpu_tests.log when OUT is set, else outputs/gpu_tests/gpu_tests.log.
# TESTS_S (default 560) cuts pytest after that many seconds, so that the summary still prints
# within a 10-minute call; a cut run says so and counts what had finished.
set -uo pipefail
cd "$(dirname "$0")/.."

SITE=${SITE:-/tmp/site}
RESULTS=${OUT:-outputs/gpu_tests}
TESTS_S=${TESTS_S:-560}
LOG="${RESULTS}/gpu_tests.log"
mkdir -p "${RESULTS}"

NAME=gpu_tests . scripts/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null \
    || echo "gpu_tests: no nvidia-smi here (without a GPU the tests skip)"
python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)"

start=$SECONDS
timeout -k 10 "${TESTS_S}" python3 -m pytest -m gpu -v -rfE -p no:cacheprovider "$@" > "${LOG}" 2>&1
rc=$?

echo "================ gpu_tests: exit ${rc}, $((SECONDS - start)) s (log: ${LOG}) ================"
grep -E "^(FAILED|ERROR) " "${LOG}" | head -20
if [ "${rc}" = 124 ] || [ "${rc}" = 137 ]; then
    echo "cut at TESTS_S=${TESTS_S} s; finished so far: $(grep -c " PASSED" "${LOG}") passed," \
         "$(grep -c " FAILED" "${LOG}") failed, $(grep -c " SKIPPED" "${LOG}") skipped"
else
    tail -n 1 "${LOG}"
fi
exit "${rc}"
