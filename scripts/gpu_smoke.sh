#!/usr/bin/env bash
# GPU smoke test: hymo_small for 20 steps on one GPU through run_train.sh (FSDP2 on the 1-rank
# mesh, bf16 parameters, per-block torch.compile, the Triton GDN kernel), then a summary:
# time to the first step, loss, tokens/s, MFU, memory.
#
# For a machine that has the repository copy but no HyMo install and no network. It needs the
# gitignored inputs carried along with the tree:
#   .whl/              TorchTitan 0.2.2 and the wheels it needs that the image lacks
#   data/brown/        python -m hymo_recipes.data.prepare (on a machine with npm)
#   assets/tokenizer/
# e.g. the device tool: carry [".whl", "data/brown", "assets/tokenizer"],
#   command "bash scripts/gpu_smoke.sh"  (results under $OUT when set, else outputs/gpu_smoke).
# Extra arguments go to run_train.sh (e.g. --training.local_batch_size 8).
set -euo pipefail
cd "$(dirname "$0")/.."

SITE=${SITE:-/tmp/site}
RESULTS=${OUT:-outputs/gpu_smoke}
RUN_DIR=${RUN_DIR:-outputs/gpu_smoke_run}  # checkpoints stay here, outside $OUT (GBs)
mkdir -p "${RESULTS}"

NAME=gpu_smoke . scripts/gpu_env.sh

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, torchtitan; print('torch', torch.__version__, '| triton', triton.__version__, '| torchtitan', torchtitan.__version__)"

rm -rf "${RUN_DIR}"
start=$(date +%s)
set +e
NGPU=1 LOG_RANK=0 CONFIG_FILE=train_configs/hymo_small.toml ./run_train.sh \
    --training.steps 20 --metrics.log_freq 1 --job.dump_folder "${RUN_DIR}" "$@" \
    2>&1 | tee "${RESULTS}/train.log"
status=${PIPESTATUS[0]}
set -e
end=$(date +%s)
cp -r "${RUN_DIR}/tb" "${RESULTS}/" 2>/dev/null || true

echo "================ gpu_smoke summary: exit ${status}, $((end - start)) s wall ================"
sed -E 's/\x1b\[[0-9;]*m//g' "${RESULTS}/train.log" | python3 -c '
import re, sys
from datetime import datetime
lines = sys.stdin.read().splitlines()
def stamp(line):
    m = re.search(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+)", line)
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f") if m else None
starts = [stamp(l) for l in lines if "Starting job" in l]
steps = [l for l in lines if re.match(r"step: *\d+ +loss", l.split(" - ")[-1])]
for l in lines:
    if "parameters" in l and "HyMo" in l or "GiB memory" in l or "Compil" in l:
        print(l.split(" - ")[-1])
if starts and steps:
    print(f"time from job start to step 1 logged (includes compile): {(stamp(steps[0]) - starts[0]).total_seconds():.0f} s")
if len(steps) > 2:
    span = (stamp(steps[-1]) - stamp(steps[1])).total_seconds() / (len(steps) - 2)
    print(f"mean step time over steps 3..{len(steps)}: {span:.3f} s")
for l in steps[:1] + steps[-3:]:
    print(l.split(" - ")[-1])
'
exit "${status}"
