#!/usr/bin/env bash
# Where the GDN kernels' GPU time goes, from Nsight Compute's hardware counters: one fwd+bwd of
# the op per shape (bf16, after two warm-up calls), every kernel with `--set full` and source
# counters, then a short table per kernel (python -m benchmarks.gdn.ncu_profile summarize).
#
# For a machine with the repository copy but no HyMo install and no network (carry .whl/,
# data/brown/, assets/tokenizer/ as for scripts/gpu_smoke.sh), e.g. the device tool:
#   command "bash benchmarks/gdn/ncu_profile.sh"   (about a minute per shape on an H200, most of it
#                                                   ncu's replays per kernel)
# Environment: SHAPES (default: HyMo's and the K = 128 shape of the benchmark), NCU (default: ncu on PATH or
# under /opt/nvidia/nsight-compute). Results under $OUT when set, else outputs/gpu_ncu_profile:
# summary.txt, and csv.tgz with ncu's CSV exports (the .ncu-rep reports stay on the machine: one
# is 14 MB at HyMo's shape and larger at K = 128).
set -uo pipefail
cd "$(dirname "$0")/../.."

SITE=${SITE:-/tmp/site}
RESULTS=${OUT:-outputs/gpu_ncu_profile}
SHAPES=${SHAPES:-4,4096,40,32,32 4,4096,16,128,128}
WORK=$(mktemp -d)
mkdir -p "${RESULTS}"
RESULTS=$(cd "${RESULTS}" && pwd)

NAME=gpu_ncu_profile . scripts/gpu_env.sh

NCU=${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)}
[ -x "${NCU}" ] || { echo "gpu_ncu_profile: no ncu found; set NCU=/path/to/ncu" >&2; exit 1; }
"${NCU}" --version | tail -1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)"

# the op launches 7 kernels per fwd+bwd (the state pass twice)
PER_CALL=7
for S in ${SHAPES}; do
    tag=$(echo "${S}" | tr , _)
    # a first process compiles the kernels into Triton's cache, so ncu times no compilation
    timeout 300 python3 -m benchmarks.gdn.ncu_profile run --shape "${S}" --iters 1 \
        || { echo "gpu_ncu_profile: the op failed at ${S}" >&2; exit 1; }
    timeout 400 "${NCU}" --clock-control none --kernel-name regex:'^_(wy|fwd|state|bwd)' \
        --launch-skip $((2 * PER_CALL)) --launch-count ${PER_CALL} --set full --import-source yes \
        -f -o "${WORK}/r_${tag}" python3 -m benchmarks.gdn.ncu_profile run --shape "${S}" --iters 3 \
        > "${WORK}/ncu_${tag}.log" 2>&1
    rc=$?
    echo "ncu ${S}: exit ${rc}"
    [ ${rc} = 0 ] || { tail -20 "${WORK}/ncu_${tag}.log"; exit 1; }
    "${NCU}" --import "${WORK}/r_${tag}.ncu-rep" --page raw --csv > "${WORK}/raw_${tag}.csv"
    for k in $(python3 -c "import sys; from benchmarks.gdn.ncu_profile import read_raw; print(' '.join(sorted({r['kernel'] for r in read_raw(sys.argv[1])})))" "${WORK}/raw_${tag}.csv"); do
        "${NCU}" --import "${WORK}/r_${tag}.ncu-rep" --page source --print-source cuda,sass --csv \
            --kernel-name "${k}" > "${WORK}/src_${k#_}_${tag}.csv"
    done
done
python3 -m benchmarks.gdn.ncu_profile summarize "${WORK}" > "${RESULTS}/summary.txt"
(cd "${WORK}" && tar czf "${RESULTS}/csv.tgz" ./*.csv ./*.log)
cat "${RESULTS}/summary.txt"
