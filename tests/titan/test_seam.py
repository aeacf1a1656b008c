"""The TorchTitan seam as a newcomer meets it: one folder imports TorchTitan, every Trainer's
builders share state only among themselves, the terminal shows a short summary, and
``./run_train.sh --help`` answers at once."""

import dataclasses
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import hymo_recipes.titan  # noqa: F401  (registers the TrainSpec and the datasets; CPU shim 1 first)
from hymo_recipes.model import HymoModel, hymo_flavors
from hymo_recipes.titan import console, job_config, spec
from hymo_recipes.titan.api import train_spec_module
from hymo_recipes.titan.help import options
from hymo_recipes.titan.optimizers import build_hymo_optimizers
from hymo_recipes.titan.train import own_train_spec, parse_config

REPO = Path(__file__).resolve().parents[2]
DEBUG = ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml")]
ENV = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}


def test_model_optimizer_data_and_kernels_import_no_torchtitan():
    code = ("import sys, hymo_recipes, hymo_recipes.model, hymo_recipes.optim, hymo_recipes.scheduler, "
            "hymo_recipes.data, hymo_kernels.gdn\n"
            "import hymo_recipes.model.report\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torchtitan'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_two_train_specs_share_no_state():
    config = parse_config(DEBUG)
    a, b = spec.get_train_spec(), spec.get_train_spec()
    loss_a, loss_b = a.build_loss_fn(config), b.build_loss_fn(config)
    assert loss_a.stats is not loss_b.stats
    assert a.model_args["debugmodel"] is not b.model_args["debugmodel"]
    assert a.model_args["debugmodel"] is not hymo_flavors["debugmodel"]
    logits = torch.randn(1, 8, 16)
    loss_a((logits, [logits, logits]), torch.randint(0, 16, (1, 8)))
    assert loss_a.stats._head_sums is not None and loss_b.stats._head_sums is None
    # a Trainer's update of its flavor stays in its spec
    a.model_args["debugmodel"].update_from_config(config)
    assert b.model_args["debugmodel"].vocab_size == hymo_flavors["debugmodel"].vocab_size != config.hymo.vocab_size
    assert not hasattr(hymo_recipes.titan.metrics, "step_stats")  # no process-wide stats object


def test_each_trainer_built_through_the_entry_point_gets_a_spec_of_its_own():
    registry = train_spec_module._extra_train_specs
    default = registry["hymo"]
    seen = []
    for _ in range(2):
        with own_train_spec():
            seen.append(train_spec_module.get_train_spec("hymo"))
    assert registry["hymo"] is default
    assert len({id(s) for s in seen + [default]}) == 3
    assert seen[0].build_loss_fn.__self__ is not seen[1].build_loss_fn.__self__


def test_preflight_takes_the_vocabulary_from_the_tokenizer_and_refuses_a_smaller_one(tmp_path):
    # a fresh dump folder: the README's default run leaves checkpoints of another vocabulary in
    # the config's, which the preflight would compare first
    debug = DEBUG + ["--job.dump_folder", str(tmp_path)]
    assert parse_config(debug).hymo.vocab_size == 8192  # the Brown BPE of ./scripts/setup.sh
    assert parse_config(debug + ["--hymo.vocab_size", "8256"]).hymo.vocab_size == 8256
    with pytest.raises(SystemExit, match="vocab_size = 100 is smaller than the tokenizer's vocabulary"):
        parse_config(debug + ["--hymo.vocab_size", "100"])
    with pytest.raises(SystemExit, match="no tokenizer.json in '/nonexistent'"):
        parse_config(debug + ["--model.hf_assets_path", "/nonexistent"])


def test_the_summary_names_flavor_shape_parameters_and_the_optimizer_partition():
    args = dataclasses.replace(hymo_flavors["debugmodel"], gdn_backend="naive")
    line = spec.describe_model("debugmodel", args)
    assert line.startswith("HyMo debugmodel: 4 layers (3 Gated DeltaNet, 1 MLA + MoE), dim 256")
    model = HymoModel(args)
    optimizers = build_hymo_optimizers([model], parse_config(DEBUG).optimizer)
    lines = spec.describe_run(parse_config(DEBUG), [model], optimizers, metrics=None)
    stored = sum(p.numel() for p in model.parameters())
    assert lines[0].startswith(f"HyMo parameters: {stored / 1e6:.2f} M stored")
    assert "normuon" in lines[-1] and "cautious_adamw" in lines[-1]
    numbers = [float(part.split()[1]) for part in lines[-1].split(": ", 1)[1].split("; ")]
    assert sum(numbers) == pytest.approx(stored / 1e6, abs=0.02)  # every parameter, once


def test_console_drops_the_json_dump_and_the_cpu_only_notices(caplog):
    root = logging.getLogger()
    console.quiet(cpu=True)
    try:
        with caplog.at_level(logging.INFO):
            for message in ['Building hymo debugmodelwith {\n  "dim": 256\n}',
                            "Peak flops undefined for: cpu, fallback to A100",
                            "Error running lspci: [Errno 2] No such file or directory: 'lspci', fallback",
                            "ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING] = 1 will be overridden to 3 based on job config",
                            "step: 1 loss: 12.6"]:
                root.info(message)
        assert [r.getMessage() for r in caplog.records] == ["step: 1 loss: 12.6"]
    finally:
        for f in [f for f in root.filters if isinstance(f, console._Filter)]:
            root.removeFilter(f)


def test_run_train_sh_help_is_fast_and_lists_the_variables_and_hymos_options():
    start = time.perf_counter()
    proc = subprocess.run(["./run_train.sh", "--help"], cwd=REPO, capture_output=True, text=True, env=ENV)
    assert time.perf_counter() - start < 5  # no torch, no torchrun
    assert proc.returncode == 0 and proc.stderr == ""
    text = proc.stdout
    assert "[rank0]" not in text and "Starting job" not in text  # nothing was launched
    for var in ("NGPU", "CONFIG_FILE", "COMM_MODE", "LOG_RANK", "TRAIN_FILE"):
        assert f"  {var} " in text
    for section, cls in (("hymo", job_config.Hymo), ("optimizer", job_config.Optimizer),
                         ("lr_scheduler", job_config.LRScheduler)):
        for f in dataclasses.fields(cls):
            assert f"--{section}.{f.name} " in text
    # HyMo's options come first, then the pointer to TorchTitan's full list
    assert text.index("--hymo.gdn_backend") < text.index("python -m hymo_recipes.train --help")


def test_help_reads_every_field_with_its_default_and_docstring():
    source = (REPO / "hymo_recipes" / "titan" / "job_config.py").read_text()
    names = [name for name, *_ in options(source, "Hymo")]
    assert names == [f.name for f in dataclasses.fields(job_config.Hymo)]
    gdn_backend = dict((n, (d, doc)) for n, _, d, doc in options(source, "Hymo"))["gdn_backend"]
    assert gdn_backend[0] == "'flavor'" and gdn_backend[1].startswith("Gated DeltaNet recurrence backend")


def test_the_entry_points_help_shows_hymos_options():
    proc = subprocess.run([sys.executable, "-m", "hymo_recipes.train", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for flag in ("--hymo.gdn-backend", "--hymo.gdn-bwd-path", "--optimizer.normuon-lr", "--lr-scheduler.warmup-fraction"):
        assert flag in proc.stdout


@pytest.mark.parametrize("counts", [[5, 0, 17, 8], [0, 0, 0, 3], [8, 16, 1, 0, 9, 2, 2, 7]])
def test_the_models_grouped_mm_layout_is_torchtitans(counts):
    """The padded layout of the model's grouped-mm experts (model/grouped_mm.py) is the one
    TorchTitan's indices_padding_wrapper builds (one expert-parallel rank), row for row."""
    from torchtitan.models.moe.kernels import generate_permute_indices
    from torchtitan.models.moe.utils import TOKEN_GROUP_ALIGN_SIZE_M, _round_up

    from hymo_recipes.model.grouped_mm import ALIGN, padded_indices

    n = torch.tensor(counts)
    rows, experts = int(n.sum()), len(counts)
    assert ALIGN == TOKEN_GROUP_ALIGN_SIZE_M
    length = _round_up(rows + experts * ALIGN, ALIGN)
    theirs, their_sizes, _ = generate_permute_indices(n, experts, 1, length, ALIGN, use_cpu=True)
    ours, our_sizes, _ = padded_indices(n, rows)
    assert torch.equal(our_sizes.to(their_sizes.dtype), their_sizes)
    assert ours.tolist() == theirs.tolist()


def test_only_the_api_module_imports_torchtitan():
    """TorchTitan's names reach HyMo through hymo_recipes/titan/api.py alone (a version bump
    touches one list): no other module of the packages imports from it."""
    import ast

    root = Path(__file__).resolve().parents[2]
    offenders = []
    for path in sorted([*(root / "hymo_recipes").rglob("*.py"), *(root / "kernels").rglob("*.py")]):
        if path == root / "hymo_recipes" / "titan" / "api.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            if any(n == "torchtitan" or n.startswith("torchtitan.") for n in names):
                offenders.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not offenders, offenders
