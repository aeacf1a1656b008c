#!/usr/bin/env bash
# The GDN kernel's GPU checks: the GPU-marked kernel tests, or the benchmark with the launch-table
# variants to compare (and the host probe with HOST_PROBE=1); a short table last.
#
# For a machine with the repository copy but no HyMo install and no network (carry .whl/,
# data/brown/, assets/tokenizer/ as for scripts/gpu_smoke.sh), e.g. the device tool:
#   command "bash scripts/gpu_gdn_check.sh"                 the tests (results under $OUT when set,
#   command "TESTS=0 BENCH=1 bash scripts/gpu_gdn_check.sh"  the benchmark   else outputs/gpu_gdn_check)
# One 10-minute device call holds one of the two on a fresh machine, not both: the 27 GPU tests
# before the tenth session took 5.7-7 minutes there (eighth session: 393 s for all 27; 26 in 400 s,
# then the Inductor test 30 s; ninth: 343 s), the eight of Config.lh_split added 191 s in the
# tenth (the 14 large-head and lh_split tests: 322 s in the twelfth), and the twelfth's third
# backward path (local_sub) and the thirteenth's saved-states dtype added parity tests, so all 55
# need at least two calls (TESTS_K="gpu_large_head or gpu_lh_split"; TESTS_K="not gpu_large_head and
# not gpu_lh_split", the other 41: 260 s in the thirteenth), and the benchmark's first fla call
# compiles for minutes (149 s for the first shape of the thirteenth session's run, with ours).
# Environment: TESTS (default 1), TESTS_S (the tests' limit, default 540 s; a cut run says so in
# gpu_tests.log), TESTS_K (a pytest -k expression selecting among them; default all), BENCH
# (default 0), VARIANTS (bench.py --variants, default "default"; e.g.
# "default,large_head,large_head_wu": the large-head path's fp32 parity at K = 128 runs 2-warp
# kernels that took minutes on an H200, so add --no-parity to BENCH_ARGS there), SHAPES (default:
# the K = 128 issue shape, then HyMo's), BENCH_S (the benchmark's time limit, default 540 s; it
# writes its JSON after every shape, so a cut run keeps what it measured), BENCH_ARGS (more
# bench.py arguments, e.g. "--rounds 2"; "--warm-procs 4" compiles every shape's kernels, fla's
# too, in 4 processes before the timing run: not yet measured on the device).
set -uo pipefail
cd "$(dirname "$0")/.."

SITE=${SITE:-/tmp/site}
RESULTS=${OUT:-outputs/gpu_gdn_check}
VARIANTS=${VARIANTS:-default}
SHAPES=${SHAPES:-4,4096,16,128,128 4,4096,40,32,32}
BENCH_S=${BENCH_S:-540}
TESTS_S=${TESTS_S:-540}
mkdir -p "${RESULTS}"

NAME=gpu_gdn_check . scripts/gpu_env.sh

nvidia-smi --query-gpu=name,memory.used,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)"

if [ "${TESTS:-1}" = 1 ]; then
    timeout -k 5 "${TESTS_S}" python3 -m pytest -v -m gpu tests/kernels/test_gdn_triton.py -p no:cacheprovider -W ignore \
        ${TESTS_K:+-k "${TESTS_K}"} > "${RESULTS}/gpu_tests.log" 2>&1
    echo "gpu tests: exit $? ($(grep -E 'passed|failed|skipped|error' "${RESULTS}/gpu_tests.log" | tail -1))"
fi

if [ "${BENCH:-0}" = 1 ]; then
    # shellcheck disable=SC2086  # SHAPES and BENCH_ARGS are lists
    timeout -k 5 "${BENCH_S}" python3 -m hymo_kernels.gdn.bench --no-eager --fast-ref --variants "${VARIANTS}" \
        --shapes ${SHAPES} ${BENCH_ARGS:-} --json "${RESULTS}/bench.json" > "${RESULTS}/bench.log" 2>&1
    echo "bench: exit $?"
fi

if [ "${HOST_PROBE:-0}" = 1 ]; then
    timeout -k 5 60 python3 -m hymo_kernels.gdn.host_probe 2>&1 | grep -v -i warn | tee "${RESULTS}/host_probe.log"
fi

if [ "${TESTS:-1}" = 1 ]; then
    grep -E "FAILED|ERROR" "${RESULTS}/gpu_tests.log" | head -20
fi
if [ "${BENCH:-0}" = 1 ]; then
    grep -E "PASS|FAIL" "${RESULTS}/bench.log" | grep -v informational | head -24
    grep -E "kernel +[0-9.]+ ms" "${RESULTS}/bench.log" | head -40
    sed -n '/^# summary/,$p' "${RESULTS}/bench.log"
fi
