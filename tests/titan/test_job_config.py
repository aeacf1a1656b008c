"""HyMo's [optimizer] / [lr_scheduler] fields merge into TorchTitan's config, feed the builders."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "optim"))  # its tiny model
import _tiny  # noqa: E402

from hymo_recipes.titan.optimizers import build_hymo_lr_schedulers, build_hymo_optimizers  # noqa: E402

CUSTOM = """
from dataclasses import dataclass, field
from hymo_recipes.titan.job_config import LRScheduler, Optimizer

@dataclass
class JobConfig:
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
"""

TOML = """
[job]
custom_config_module = "{module}"

[optimizer]
normuon_lr = 0.01
moe_on_normuon = false
embed_weight_decay = 0.02

[lr_scheduler]
warmup_fraction = 0.1
stable_fraction = 0.5
decay_fraction = 0.4
decay_type = "sqrt"

[training]
steps = 20
"""


@pytest.fixture
def parse(tmp_path, monkeypatch):
    from torchtitan.config import ConfigManager

    module = "hymo_optim_config_under_test"
    (tmp_path / f"{module}.py").write_text(CUSTOM)
    (tmp_path / "job.toml").write_text(TOML.format(module=module))
    monkeypatch.syspath_prepend(str(tmp_path))

    def _parse(*cli):
        return ConfigManager().parse_args(["--job.config_file", str(tmp_path / "job.toml"), *cli])

    return _parse


def test_fields_parse_with_defaults_toml_and_cli(parse):
    cfg = parse("--optimizer.normuon_update_scale", "rms", "--optimizer.no-adamw_cautious_wd")
    o, s = cfg.optimizer, cfg.lr_scheduler
    assert (o.name, o.lr, o.normuon_lr, o.normuon_momentum) == ("NorMuon", 2.4e-3, 0.01, 0.95)
    assert (o.normuon_update_scale, o.adamw_cautious_wd, o.moe_on_normuon) == ("rms", False, False)
    assert (o.normuon_orthogonalizer, o.normuon_ortho_dtype) == ("polar_express", "bfloat16")
    assert (s.warmup_fraction, s.decay_type) == (0.1, "sqrt")
    assert (s.min_lr_factor, s.warmup_steps) == (0.05, None)


def test_builders_accept_the_parsed_sections(parse):
    cfg = parse()
    model = _tiny.make_model()
    opts = build_hymo_optimizers([model], cfg.optimizer, None)
    scheds = build_hymo_lr_schedulers(opts, cfg.lr_scheduler, cfg.training.steps)
    # moe_on_normuon = false: the 3-D experts are in CautiousAdamW; the embedding decays at 0.02
    adamw = opts.optimizers[opts.optimizer_names.index("cautious_adamw")]
    experts_w1 = model.layers["0"].moe.experts.w1
    assert any(p is experts_w1 for g in adamw.param_groups for p in g["params"])
    emb = next(g for g in adamw.param_groups if g["group"] == "embedding")
    assert emb["weight_decay"] == 0.02
    # 20 steps × 10% warmup: step 1 runs at 1/2 of the peak lr
    assert opts.lrs()["normuon"] == pytest.approx(0.005)
    assert scheds.schedule.decay_type == "sqrt" and scheds.schedule.warmup_steps == 2


def test_step_based_warmup_is_refused(parse):
    cfg = parse("--lr_scheduler.warmup_steps", "10")
    with pytest.raises(ValueError, match="warmup_fraction"):
        build_hymo_lr_schedulers(None, cfg.lr_scheduler, cfg.training.steps)
