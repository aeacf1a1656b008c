"""Every TOML in train_configs/ parses, follows the conventions, and bad configs fail clearly."""

from dataclasses import is_dataclass
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import hymo_recipes  # noqa: F401  (registers the TrainSpec and the datasets)
from hymo_recipes._titan import DATASETS, ConfigManager
from hymo_recipes.model import hymo_flavors
from hymo_recipes.train import parse_config

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "train_configs").glob("*.toml"))


def test_the_three_configs_exist():
    assert {c.name for c in CONFIGS} >= {"debug_model.toml", "hymo_small.toml", "hymo_750m.toml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_parses_into_a_hymo_run(path):
    config = ConfigManager().parse_args(["--job.config_file", str(path)])
    assert config.model.name == "hymo"
    assert config.model.flavor in hymo_flavors
    assert config.experimental.custom_import == "hymo_recipes"
    assert config.job.custom_config_module == "hymo_recipes.job_config"
    assert config.training.dataset in DATASETS
    assert not config.validation.enable or config.validation.dataset in DATASETS
    # resumable at the end, not just exportable
    assert config.checkpoint.enable and not config.checkpoint.last_save_model_only


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_opens_with_hardware_and_launch_line(path):
    header = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    header = "\n".join(header)
    assert "Hardware:" in header and "run_train.sh" in header, header


# What a config trains is stated even where it matches a default.
ALWAYS_STATED = {"model.name", "model.flavor"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_sets_only_values_that_differ_from_the_defaults(path):
    toml = tomllib.loads(path.read_text())
    # the JobConfig class parse_args builds for this TOML (TorchTitan merged with [hymo])
    merged = ConfigManager()._maybe_add_custom_config([], toml)
    defaults = merged()

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
    args = _write(tmp_path, '[job]\ncustom_config_module = "hymo_recipes.job_config"\n'
                            '[hymo]\ngdn_backnd = "triton"\n')
    with pytest.raises(SystemExit, match="gdn_backnd"):
        parse_config(args)


def test_hymo_section_parses_and_validates(tmp_path):
    args = _write(tmp_path, '[job]\ncustom_config_module = "hymo_recipes.job_config"\n'
                            '[hymo]\ngdn_backend = "naive"\n')
    assert parse_config(args).hymo.gdn_backend == "naive"
    assert parse_config(args + ["--hymo.gdn_backend", "triton"]).hymo.gdn_backend == "triton"
    assert parse_config(args).hymo.gdn_dot_precision == "table"
    assert parse_config(args + ["--hymo.gdn_dot_precision", "bf16"]).hymo.gdn_dot_precision == "bf16"
    with pytest.raises(SystemExit):  # not one of its choices
        parse_config(args + ["--hymo.gdn_dot_precision", "fp8"])
    assert parse_config(args).hymo.gdn_bwd_path == "table"
    assert parse_config(args + ["--hymo.gdn_bwd_path", "local"]).hymo.gdn_bwd_path == "local"
    with pytest.raises(SystemExit):
        parse_config(args + ["--hymo.gdn_bwd_path", "fast"])


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
