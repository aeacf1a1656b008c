"""What a run prints at the terminal: TorchTitan's log minus the lines that say nothing about it.

``quiet(cpu)`` (HyMo's entry point calls it once logging is set up) drops, by their exact text:

- TorchTitan's dump of the model args as 50 lines of JSON ("Building hymo <flavor>with {...}"):
  the builders log a few-line summary instead (spec.py: flavor, shape, parameters, FLOPs per
  token, which optimizer takes which parameters);
- on a machine without an accelerator: TorchTitan's NCCL environment notices (``ENV[...] will
  be overridden``: gloo ignores them), its peak-FLOPS lookup warnings ("Error running lspci",
  "Peak flops undefined for: cpu, fallback to A100", each logged twice; the summary says once
  what MFU means here), and torch's "DTensor ... may not have complete support on cpu device
  mesh" notices (FSDP2 over gloo is what a CPU run is, and its numbers are checked by tests);
- everywhere: torchdata's "'set_vital' is deprecated" warning, raised inside torchdata's own
  dataloader at every epoch start.

Everything else, every warning included, is left as it is.
"""

from __future__ import annotations

import logging
import warnings

_DROPPED_ON_CPU = ("Error running lspci", "Peak flops undefined for: cpu")


class _Filter(logging.Filter):
    def __init__(self, cpu: bool):
        super().__init__()
        self.cpu = cpu

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("Building ") and "with {" in message:
            return False  # the model args as JSON (torchtitan/train.py)
        if self.cpu and (message.startswith(_DROPPED_ON_CPU)
                         or (message.startswith("ENV[") and "will be overridden" in message)):
            return False
        return True


def quiet(cpu: bool) -> None:
    """Installs the filters described in the module docstring (idempotent)."""
    root = logging.getLogger()  # TorchTitan logs on the root logger
    if not any(isinstance(f, _Filter) for f in root.filters):
        root.addFilter(_Filter(cpu))
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
    if cpu:
        warnings.filterwarnings("ignore", message=r"DTensor .* may not have complete support on cpu device mesh")
