"""Every TOML in train_configs/ parses, follows the conventions, and bad configs fail clearly."""

from dataclasses import is_dataclass
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import hymo_recipes.titan  # noqa: F401  (registers the TrainSpec and the datasets; CPU shim 1 first)
from hymo_recipes.titan.api import DATASETS, ConfigManager
from hymo_recipes.model import hymo_flavors
from hymo_recipes.titan.train import parse_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "train_configs").glob("*.toml"))


def test_the_three_configs_exist():
    assert {c.name for c in CONFIGS} >= {"debug_model.toml", "hymo_small.toml", "hymo_750m.toml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_parses_into_a_hymo_run(path):
    config = ConfigManager().parse_args(["--job.config_file", str(path)])
    assert config.model.name == "hymo"
    assert config.model.flavor in hymo_flavors
    assert config.experimental.custom_import == "hymo_recipes.titan"
    assert config.job.custom_config_module == "hymo_recipes.titan.job_config"
    assert config.training.dataset in DATASETS
    assert not config.validation.enable or config.validation.dataset in DATASETS
    # resumable at the end, not just exportable
    assert config.checkpoint.enable and not config.checkpoint.last_save_model_only


# What a config trains is stated even where it matches a default.
# the model, and the batch each config was measured at (TorchTitan's default local batch is 8)
ALWAYS_STATED = {"model.name", "model.flavor", "training.local_batch_size"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_lint_config_conventions(path):
    """House style, not behaviour: a config opens with its hardware and launch line, and sets
    only values that differ from the defaults."""
    header = "\n".join(line for line in path.read_text().splitlines()[:12] if line.startswith("#"))
    assert "Hardware:" in header and "run_train.sh" in header, header

    toml = tomllib.loads(path.read_text())
    # the JobConfig class parse_args builds for this TOML (TorchTitan merged with [hymo])
    defaults = ConfigManager()._maybe_add_custom_config([], toml)()

    def same_as_default(section, values, prefix):
        for key, value in values.items():
            default = getattr(section, key)
            if is_dataclass(default):
                yield from same_as_default(default, value, f"{prefix}{key}.")
            elif value == default and f"{prefix}{key}" not in ALWAYS_STATED:
                yield f"{prefix}{key} = {value!r}"

    assert list(same_as_default(defaults, toml, "")) == []


def _write(tmp_path, text):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    return ["--job.config_file", str(path)]


def test_unknown_key_names_the_key(tmp_path):
    with pytest.raises(SystemExit, match="stepz"):
        parse_config(_write(tmp_path, "[training]\nstepz = 3\n"))


def test_unknown_hymo_key_names_the_key(tmp_path):
    args = _write(tmp_path, '[job]\ncustom_config_module = "hymo_recipes.titan.job_config"\n'
                            '[hymo]\ngdn_backnd = "triton"\n')
    with pytest.raises(SystemExit, match="gdn_backnd"):
        parse_config(args)


HYMO_TOML = ('[model]\nname = "hymo"\nflavor = "debugmodel"\nhf_assets_path = "./assets/tokenizer"\n'
             '[training]\ndataset = "brown"\nseq_len = 64\nsteps = 10\n[lr_scheduler]\nwarmup_fraction = 0.1\nstable_fraction = 0.75\n')


def test_hymo_section_parses_and_each_knob_is_validated_once(tmp_path):
    """The [hymo] knobs parse from the TOML and the CLI; a value the model args refuse (the one
    place each knob is validated) fails in one line before the Trainer."""
    args = _write(tmp_path, HYMO_TOML + '[hymo]\ngdn_backend = "naive"\n')
    assert parse_config(args).hymo.gdn_backend == "naive"
    assert parse_config(args + ["--hymo.gdn_backend", "torch_chunk"]).hymo.gdn_backend == "torch_chunk"
    assert parse_config(args).hymo.gdn_dot_precision == "flavor"
    big = args + ["--hymo.gdn_backend", "triton"]  # the tests run the Triton kernel in its interpreter
    assert parse_config(big + ["--hymo.gdn_dot_precision", "bf16"]).hymo.gdn_dot_precision == "bf16"
    with pytest.raises(SystemExit, match="invalid job config.*unknown gdn_dot_precision 'fp8'; choose one of"):
        parse_config(big + ["--hymo.gdn_dot_precision", "fp8"])
    assert parse_config(big + ["--hymo.gdn_bwd_path", "local"]).hymo.gdn_bwd_path == "local"
    with pytest.raises(SystemExit, match="invalid job config.*unknown gdn_bwd_path 'split'; choose one of"):
        parse_config(big + ["--hymo.gdn_bwd_path", "split"])
    with pytest.raises(SystemExit, match="invalid job config.*unknown gdn_backend 'tritn'"):
        parse_config(args + ["--hymo.gdn_backend", "tritn"])
    assert parse_config(big + ["--hymo.gdn_mixer_saves", "outputs"]).hymo.gdn_mixer_saves == "outputs"
    # a memory choice of the fused mixer: a PyTorch backend takes it (and keeps what autograd keeps)
    assert parse_config(args + ["--hymo.gdn_mixer_saves", "outputs"]).hymo.gdn_mixer_saves == "outputs"
    with pytest.raises(SystemExit, match="invalid job config.*unknown gdn_mixer_saves 'all'; choose one of"):
        parse_config(big + ["--hymo.gdn_mixer_saves", "all"])


@pytest.mark.parametrize("config", ["hymo_small.toml", "hymo_750m.toml"])
def test_a_gpu_config_parses_with_a_cpu_backend(config):
    """The preflight's advice for a machine without a GPU (--hymo.gdn_backend torch_chunk, and
    --optimizer.no-cuda_graph and --optimizer.no-normuon_fused where the config uses them) works
    with every shipped GPU config, whatever its mixer keeps."""
    path = Path(__file__).resolve().parents[2] / "train_configs" / config
    parsed = parse_config(["--job.config_file", str(path), "--hymo.gdn_backend", "torch_chunk", "--compile.no-enable",
                           "--optimizer.no-cuda_graph", "--optimizer.no-normuon_fused", "--job.dump_folder",
                           "/nonexistent-hymo-dump"])
    assert parsed.hymo.gdn_backend == "torch_chunk"


def test_hymo_options_parse_without_the_custom_config_module(tmp_path):
    """HyMo's entry point merges HyMo's job config whether or not the TOML names it."""
    config = parse_config(_write(tmp_path, HYMO_TOML) + ["--hymo.gdn_backend", "naive"])
    assert config.hymo.gdn_backend == "naive" and config.optimizer.normuon_lr == 0.02


def test_malformed_toml_names_the_file_and_position(tmp_path):
    args = _write(tmp_path, "[training]\nsteps = = 3\n")
    with pytest.raises(SystemExit, match=r"bad\.toml.*line 2"):
        parse_config(args)


def test_missing_config_file(tmp_path):
    with pytest.raises(SystemExit, match="No such file"):
        parse_config(["--job.config_file", str(tmp_path / "missing.toml")])


def test_run_train_sh_rejects_a_malformed_config_before_launching(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "bad.toml"
    bad.write_text("[training]\nsteps = = 3\n")
    proc = subprocess.run(["./run_train.sh"], cwd=REPO, capture_output=True, text=True,
                          env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "NGPU": "1",
                               "CONFIG_FILE": str(bad)})
    assert proc.returncode != 0
    assert f"cannot use CONFIG_FILE={bad}: Invalid value (at line 2" in proc.stderr
    assert "torchrun" not in proc.stderr  # stopped before launching anything
