"""The non-finite probe names the unit and the submodule where a NaN/Inf is born."""

import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hymo_recipes.nonfinite_probe import NonfiniteProbe


class Log(nn.Module):  # log of a negative number: NaN from finite inputs
    def forward(self, x):
        return torch.log(x)


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen += 1
        return x * 2


class Net(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.layers = nn.ModuleDict({"0": nn.Linear(4, 4), "1": block})
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers.values():
            x = layer(x)
        return self.out(x)


class Bad(nn.Module):
    """Stands in for a compiled block whose generated code is wrong: eager is ``_orig_mod``."""

    def __init__(self, inner):
        super().__init__()
        self._orig_mod = inner

    def forward(self, x):
        out = self._orig_mod(x).clone()
        out[1, 2] = float("nan")
        return out


@pytest.fixture
def logs(caplog):
    caplog.set_level(logging.INFO)
    return caplog


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def _make_positive_then_negative(net, sign):
    with torch.no_grad():
        net.layers["0"].weight.zero_()
        net.layers["0"].bias.fill_(sign)


def test_names_unit_and_submodule_and_resets_per_forward(logs):
    torch.manual_seed(0)
    net = Net(nn.Sequential(Counter(), Log(), nn.Linear(4, 4)))
    probe = NonfiniteProbe(net, log_every=1)
    _make_positive_then_negative(net, 1.0)
    net(torch.randn(3, 4))
    assert "forward 1: all finite" in logs.text and not _warnings(logs)
    _make_positive_then_negative(net, -1.0)
    logs.clear()
    net(torch.randn(3, 4))
    (msg,) = _warnings(logs)
    # layers.1 is the unit where the NaN is born (out only carries it); inside it, the Log.
    assert "forward 2: non-finite output first appears in layers.1 (Sequential)" in msg
    assert "eager replay is non-finite too, first in layers.1.1 (Log)" in msg
    assert "first at (0, 0)" in msg
    # the replay put the unit's buffers back: two forwards, two counts
    assert float(net.layers["1"][0].seen) == 2.0
    probe.remove()
    logs.clear()
    net(torch.randn(3, 4))
    assert logs.text == ""


def test_compiled_unit_that_eager_replays_finite_is_blamed(logs):
    torch.manual_seed(0)
    net = Net(Bad(nn.Sequential(Counter(), nn.Linear(4, 4))))
    NonfiniteProbe(net)
    net(torch.randn(3, 4))
    (msg,) = _warnings(logs)
    assert "first appears in layers.1 (Bad)" in msg and "first at (1, 2)" in msg
    assert "eager replay on the same inputs is finite" in msg and "the compiled code" in msg
    assert float(net.layers["1"]._orig_mod[0].seen) == 1.0


def test_real_compiled_unit_replayed_inside(logs):
    net = Net(torch.compile(nn.Sequential(nn.Identity(), Log()), backend="eager", fullgraph=True))
    _make_positive_then_negative(net, -1.0)
    NonfiniteProbe(net)
    net(torch.randn(3, 4))
    (msg,) = _warnings(logs)
    assert "first appears in layers.1 (OptimizedModule)" in msg
    assert "non-finite too, first in layers.1.1 (Log)" in msg


def test_nan_from_outside_the_units(logs):
    net = Net(nn.Linear(4, 4))
    NonfiniteProbe(net)
    net(torch.full((3, 4), float("nan")))
    (msg,) = _warnings(logs)
    assert "inp got non-finite inputs from outside the watched units" in msg


def test_replay_of_a_resharded_fsdp_unit(logs, tmp_path):
    """Under FSDP2 the unit's parameters are resharded by the time the probe replays it."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        net = Net(Bad(nn.Sequential(Counter(), nn.Linear(4, 4))))
        NonfiniteProbe(net)  # before fully_shard, as parallelize_hymo does
        fully_shard(net.layers["1"])
        fully_shard(net)
        net(torch.randn(3, 4))
        (msg,) = _warnings(logs)
        assert "first appears in layers.1 (FSDPBad)" in msg
        assert "eager replay on the same inputs is finite" in msg
    finally:
        dist.destroy_process_group()


class UnwrittenTail(nn.Module):
    """Returns its rows in a layout with a row it never writes (NaN here), and says which rows
    hold values, as the grouped MoE experts do (GroupedExperts.defined_outputs)."""

    def forward(self, x):
        out = torch.cat([x, torch.full_like(x[:1], float("nan"))])
        return out, torch.arange(x.shape[0])

    @staticmethod
    def defined_outputs(output):
        from hymo_recipes.model.moe import GroupedExperts

        return GroupedExperts.defined_outputs(output)


class ReadsItsRows(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = UnwrittenTail()
        self.log = Log()

    def forward(self, x):
        out, at = self.experts(x)
        return self.log(out[at])


def test_rows_a_module_never_writes_are_not_blamed(logs):
    torch.manual_seed(0)
    net = Net(ReadsItsRows())
    probe = NonfiniteProbe(net, log_every=1)
    _make_positive_then_negative(net, -1.0)  # the Log's input is negative: NaN born there
    net(torch.randn(3, 4))
    (msg,) = _warnings(logs)
    assert "first in layers.1.log (Log)" in msg, msg
    probe.remove()
