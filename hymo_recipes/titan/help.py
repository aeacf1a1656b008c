"""``./run_train.sh --help``: run_train.sh's environment and HyMo's own options, in a blink.

    python3 hymo_recipes/titan/help.py

Run by path, not imported: importing ``hymo_recipes.titan`` imports TorchTitan and torch
(seconds). The options are read from job_config.py's source (its dataclasses, their defaults
and the docstring under each field), so this page and the parser cannot disagree. TorchTitan's
full list, HyMo's options included, is ``python -m hymo_recipes.train --help``.
"""

from __future__ import annotations

import ast
import sys
import textwrap
from pathlib import Path

JOB_CONFIG = Path(__file__).with_name("job_config.py")

ENVIRONMENT = (
    ("NGPU", "processes to start: one per visible GPU by default, 2 CPU processes (FSDP2 over "
             "gloo) when there is no GPU"),
    ("CONFIG_FILE", "the TOML to train with (default ./train_configs/debug_model.toml)"),
    ("CHECK", "set (CHECK=1): check the config for NGPU processes on any machine, GPU-less included, without "
              "training: data, tokenizer, model on the meta device, optimizer partition, memory per GPU "
              "(hymo_recipes/titan/check.py)"),
    ("COMM_MODE", "fake_backend | local_tensor: one process pretends to be NGPU ranks, checks the "
                  "config, builds the model and runs one step (no checkpoint)"),
    ("LOG_RANK", "the ranks whose output is shown, comma-separated (default 0)"),
    ("TRAIN_FILE", "the module torchrun runs (default hymo_recipes.train)"),
    ("NNODES", "nodes of the job, this script started once on each (default 1)"),
    ("NODE_RANK", "this node's rank for the static rendezvous (default 0)"),
    ("MASTER_ADDR", "node 0's host for the static rendezvous of several nodes (+ MASTER_PORT, default 29500)"),
    ("RDZV_ENDPOINT", "host:port of a c10d rendezvous for several nodes instead (+ RDZV_ID, default hymo)"),
)

# (section, class in job_config.py, what the section is)
SECTIONS = (
    ("hymo", "Hymo", "HyMo's own section"),
    ("optimizer", "Optimizer", "HyMo's fields; lr, beta1, beta2, eps, weight_decay are TorchTitan's, "
                               "here CautiousAdamW's (or AdamW's)"),
    ("lr_scheduler", "LRScheduler", "HyMo's fields; TorchTitan's warmup_steps and decay_ratio must "
                                    "stay unset"),
)


def options(source: str, class_name: str) -> list[tuple[str, str, str, str]]:
    """(name, type, default, docstring) of each field of a dataclass in ``source``."""
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    out = []
    for node, after in zip(cls.body, cls.body[1:] + [None]):
        if not isinstance(node, ast.AnnAssign):
            continue
        default = ast.unparse(node.value) if node.value is not None else ""
        if default.startswith("field(default_factory=list"):
            default = "[]"
        doc = ""
        if (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            doc = " ".join(after.value.value.split())
        out.append((node.target.id, ast.unparse(node.annotation), default, doc))
    return out


def render(width: int = 100) -> str:
    source = JOB_CONFIG.read_text()
    lines = ["Usage: [VAR=value ...] ./run_train.sh [--section.key value ...]",
             "Arguments after the script override the TOML (CLI > TOML > defaults); booleans are "
             "--section.key / --section.no-key (or --section.key=true / false).", "", "Environment (run_train.sh):"]
    for name, what in ENVIRONMENT:
        lines += textwrap.wrap(what, width, initial_indent=f"  {name:<12} ", subsequent_indent=" " * 15)
    lines += ["", "HyMo's options (hymo_recipes/titan/job_config.py):"]
    for section, class_name, what in SECTIONS:
        lines += ["", f"[{section}]: {what}"]
        for name, hint, default, doc in options(source, class_name):
            lines.append(f"  --{section}.{name} {hint} (default {default})")
            if doc:
                lines += textwrap.wrap(doc, width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    lines += ["", "TorchTitan's full list of options, HyMo's included: python -m hymo_recipes.train --help"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(render() + "\n")
