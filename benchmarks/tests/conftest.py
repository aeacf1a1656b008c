import os

import torch

# Without a GPU the Triton kernels run in Triton's CPU interpreter. triton.jit reads this
# variable when a kernel module is imported, and the benchmarks import the model (and through
# it the kernels), so it is set here, before any test module of the instruments loads: the
# order in which a worker imports them then does not matter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
