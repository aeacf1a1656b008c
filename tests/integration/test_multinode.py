"""Two "nodes" on this machine: run_train.sh started twice, NNODES=2 with NODE_RANK 0 and 1 and
one CPU process each (gloo), must train the debug model exactly as one node with two processes
(NGPU=2) does in one uninterrupted run: the same loss at every step, for a first run that stops
at a checkpoint and for its resume. The first run meets through the static rendezvous (MASTER_ADDR / MASTER_PORT), the
resume through c10d (RDZV_ENDPOINT / RDZV_ID), each on a free port.

The two agents share the dump folder (a shared filesystem) and the machine's two cores, so each
rank gets one OpenMP thread, as torchrun gives each of NGPU=2 local ranks: with the same world
size, ranks, data and threads, the numbers are bitwise the same.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIG = "train_configs/debug_model.toml"
MULTINODE_VARS = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "RDZV_ENDPOINT", "RDZV_ID",
                  "OMP_NUM_THREADS", "NGPU", "LOG_RANK", "CHECK", "COMM_MODE")
TIMEOUT_S = 300  # one launch takes ~30 s here; a node left waiting for its peer is killed after this


def _test_train():
    """tests/integration/test_train.py's helpers (run_train, read_scalars, the metric comparison),
    loaded by path so that this works under any pytest import mode."""
    spec = importlib.util.spec_from_file_location("hymo_test_train", Path(__file__).with_name("test_train.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up there
    spec.loader.exec_module(mod)
    return mod


tt = _test_train()
prepared_data = tt.prepared_data  # the autouse check that the data and tokenizer exist
pytestmark = pytest.mark.slow

# 2 steps, a full checkpoint at step 2, then 2 more from it; the lr moves every step and the
# schedule is pinned to the 4 steps. No validation (time).
COMMON = ("--lr_scheduler.total_steps", "4", "--validation.no-enable", *tt.MOVING_LR)
FIRST, RESUMED = ("--training.steps", "2"), ("--training.steps", "4")

ANSI = re.compile(r"\x1b\[[0-9;]*m")
STEP_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*(\S+)\s+grad_norm:")  # not "validate step: 1  loss: ..."


def logged_losses(log: str) -> dict[int, float]:
    """{step: loss} from TorchTitan's per-step training lines ("step:  3  loss: 12.55989  grad_norm: ...")."""
    losses: dict[int, float] = {}
    for step, loss in STEP_LINE.findall(ANSI.sub("", log)):
        assert int(step) not in losses, f"step {step} logged twice"
        losses[int(step)] = float(loss)
    return losses


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_nodes(dump_folder: Path, name: str, node_env: list[dict[str, str]], *overrides: str) -> list[str]:
    """run_train.sh once per node (its extra environment), all at once; waits for every node,
    returns their outputs (also in <dump_folder>.<name>.node<rank>.log). A node that exits non-zero, or that still runs after TIMEOUT_S (its
    peer died), fails the test; the other nodes are then stopped."""
    base = dict(os.environ, NGPU="1", CONFIG_FILE=CONFIG, NNODES=str(len(node_env)), OMP_NUM_THREADS="1")
    base["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{base.get('PATH', '')}"
    logs = [dump_folder.parent / f"{dump_folder.name}.{name}.node{i}.log" for i in range(len(node_env))]
    procs = []
    try:
        for extra, log in zip(node_env, logs):
            with open(log, "w") as out:  # the child keeps its own descriptor
                procs.append(subprocess.Popen(
                    ["./run_train.sh", "--job.dump_folder", str(dump_folder), *overrides],
                    cwd=REPO, env=dict(base, **extra), stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True))  # its own process group: torchrun and its rank go with it
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]  # every node's, each time
            if None not in codes:
                break
            if any(c not in (None, 0) for c in codes):
                time.sleep(10)  # a node failed: let its peers fail or finish on their own, then stop them
                break
            time.sleep(0.5)
    finally:
        killed = [p.poll() is None for p in procs]
        for p, kill in zip(procs, killed):
            if kill:
                os.killpg(p.pid, signal.SIGKILL)  # the group start_new_session made for this node
                p.wait()
    outputs = [log.read_text(errors="replace") for log in logs]
    codes = ", ".join(f"node {r}: " + ("killed (still running)" if k else f"exit {p.returncode}")
                      for r, (p, k) in enumerate(zip(procs, killed)))
    # the first node that failed on its own tells why; a peer left waiting for it is only killed
    for rank, (p, out, kill) in sorted(enumerate(zip(procs, outputs, killed)), key=lambda x: x[1][2]):
        assert p.returncode == 0 and not kill, f"{codes}; node {rank}'s output:\n{out[-6000:]}"
    return outputs


def assert_losses(outputs: list[str], expected: dict[int, float], steps: list[int]) -> None:
    for rank, out in enumerate(outputs):
        losses = logged_losses(out)
        assert sorted(losses) == steps, f"node {rank} logged steps {sorted(losses)}, not {steps}:\n{out[-4000:]}"
        assert losses == expected, f"node {rank}: {losses} != one node's {expected}"


def test_two_nodes_train_and_resume_like_one_node_with_two_processes(tmp_path, monkeypatch):
    for var in MULTINODE_VARS:  # the reference is run_train.sh's plain single-node launch
        monkeypatch.delenv(var, raising=False)

    # one node, NGPU=2: steps 1-4 in one run (a stop at step 2 and its resume give these numbers
    # bitwise: tests/integration/test_train.py::test_two_process_stop_and_resume_is_bitwise)
    one = tmp_path / "one_node"
    ref = logged_losses(tt.run_train(one, 2, *COMMON, *RESUMED))
    assert sorted(ref) == [1, 2, 3, 4] and all(v == v and v < 20 for v in ref.values()), ref
    ref_first, ref_resumed = {s: ref[s] for s in (1, 2)}, {s: ref[s] for s in (3, 4)}

    # two nodes of one process each; static rendezvous at node 0
    two = tmp_path / "two_nodes"
    port = str(free_port())
    outputs = run_nodes(two, "first", [dict(NODE_RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                                       for r in (0, 1)], *COMMON, *FIRST)
    assert all("--nnodes=2 --node_rank=%d --rdzv_backend static" % r in out for r, out in enumerate(outputs))
    assert all("Applied FSDP2 to the model on a mesh of 2 rank(s)" in out for out in outputs)
    assert_losses(outputs, ref_first, [1, 2])
    # both ranks wrote their shard of the step-2 checkpoint into the shared folder
    assert sorted(p.name for p in (two / "checkpoint" / "step-2").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]

    # resumed from that checkpoint through a c10d rendezvous (it numbers the nodes itself)
    endpoint = f"127.0.0.1:{free_port()}"
    outputs = run_nodes(two, "resumed", [dict(RDZV_ENDPOINT=endpoint, RDZV_ID=f"hymo-test-{os.getpid()}")] * 2,
                        *COMMON, *RESUMED)
    assert all(f"--rdzv_backend c10d --rdzv_endpoint={endpoint}" in out for out in outputs)
    assert all("Training starts at step 3" in out for out in outputs)
    assert_losses(outputs, ref_resumed, [3, 4])

    # and every logged number (tensorboard, exact floats: losses, each head, lr, grad norm, MoE
    # load), steps 1-4 over both runs, is the one-node run's
    tt.assert_same_training_metrics(tt.read_scalars(one), tt.read_scalars(two))
