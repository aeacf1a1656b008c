"""scripts/launch.py, run_train.sh's torchrun: quiet after config errors, torchrun's report otherwise."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

REPO = Path(__file__).resolve().parents[2]


def _launch_module():
    spec = importlib.util.spec_from_file_location("hymo_launch", REPO / "scripts" / "launch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _failed() -> ChildFailedError:
    return ChildFailedError("hymo_recipes.train", {0: ProcessFailure(0, os.getpid(), 1, "<N/A>")})


@pytest.mark.parametrize("config_error", [True, False], ids=["config-error", "other-failure"])
def test_launch_swallows_torchrun_report_only_after_a_config_error(monkeypatch, config_error):
    launch = _launch_module()
    monkeypatch.delenv(launch.CONFIG_ERROR_FILE, raising=False)
    seen = {}

    def fake_torchrun(argv):
        path = seen["path"] = os.environ[launch.CONFIG_ERROR_FILE]
        seen["argv"] = argv
        if config_error:
            with open(path, "a") as f:
                f.write("hymo: invalid job config (...): bad\n")
        raise _failed()

    monkeypatch.setattr(launch, "torchrun", fake_torchrun)
    if config_error:
        assert launch.main(["--nproc_per_node=2", "-m", "x"]) == 1
    else:
        with pytest.raises(ChildFailedError):
            launch.main(["--nproc_per_node=2", "-m", "x"])
    assert seen["argv"] == ["--nproc_per_node=2", "-m", "x"]
    assert not os.path.exists(seen["path"])  # the note file is removed either way, and its name
    assert launch.CONFIG_ERROR_FILE not in os.environ  # with it


def test_launch_returns_0_when_torchrun_succeeds(monkeypatch):
    launch = _launch_module()
    monkeypatch.setattr(launch, "torchrun", lambda argv: None)
    assert launch.main([]) == 0
    assert launch.CONFIG_ERROR_FILE not in os.environ


@pytest.mark.parametrize("argv, threads", [(["--nproc_per_node=2"], "1"), (["--nproc_per_node", "2"], "1"),
                                           (["--nproc_per_node=1"], None), ([], None)])
def test_launch_sets_torchruns_thread_default_itself_and_leaves_no_trace(monkeypatch, argv, threads):
    """One OpenMP thread per rank when several share the host, as torchrun would set (without
    its banner); gone from the environment afterwards; a value the user set is kept."""
    launch = _launch_module()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    seen = {}
    monkeypatch.setattr(launch, "torchrun", lambda a: seen.setdefault("threads", os.environ.get("OMP_NUM_THREADS")))
    assert launch.main(argv + ["-m", "x"]) == 0
    assert seen["threads"] == threads and "OMP_NUM_THREADS" not in os.environ
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    seen.clear()
    launch.main(argv + ["-m", "x"])
    assert seen["threads"] == "3"


def test_parse_config_notes_its_error_for_the_launcher(tmp_path, monkeypatch):
    from hymo_recipes.titan.train import parse_config

    note = tmp_path / "note"
    note.write_text("")
    monkeypatch.setenv("HYMO_CONFIG_ERROR_FILE", str(note))
    args = ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), "--model.flavor", "nope"]
    # under the launcher: the line goes to the note (the launcher prints it once), the rank exits 1
    with pytest.raises(SystemExit) as stop:
        parse_config(args)
    assert stop.value.code == 1
    assert "unknown [model] flavor 'nope'" in note.read_text()
    # on its own (no launcher): the rank says it
    monkeypatch.delenv("HYMO_CONFIG_ERROR_FILE")
    with pytest.raises(SystemExit, match="unknown \\[model\\] flavor 'nope'"):
        parse_config(args)


def test_run_train_sh_reports_a_config_error_in_one_line(tmp_path):
    env = dict(os.environ, NGPU="2", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = subprocess.run(["./run_train.sh", "--job.dump_folder", str(tmp_path), "--model.flavor", "nope"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    assert "unknown [model] flavor 'nope': HyMo has debugmodel" in out
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-4000:]
    assert not list(tmp_path.iterdir())  # nothing written before the check


@pytest.mark.parametrize("env, message", [
    ({"NNODES": "two"}, "NNODES=two is not a positive integer"),
    ({"NNODES": "0"}, "NNODES=0 is not a positive integer"),
    ({"NNODES": "2", "NODE_RANK": "x", "MASTER_ADDR": "node0"}, "NODE_RANK=x is not a non-negative integer"),
    ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "node0"}, "NODE_RANK=2 must be below NNODES=2"),
    ({"NODE_RANK": "1"}, "NODE_RANK=1 must be below NNODES=1"),
    ({"NNODES": "2"}, "NNODES=2 needs a rendezvous all nodes reach: MASTER_ADDR"),
    ({"NNODES": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a port number"),
], ids=["nnodes-word", "nnodes-0", "node-rank-word", "node-rank-too-big", "node-rank-one-node",
        "no-rendezvous", "bad-port"])
def test_run_train_sh_rejects_bad_multinode_values_in_one_line(tmp_path, env, message):
    """Before torchrun starts (which would wait for nodes that never come): one line, exit 1."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "RDZV_ENDPOINT", "CHECK", "COMM_MODE")}
    base["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    proc = subprocess.run(["./run_train.sh", "--job.dump_folder", str(tmp_path)], cwd=REPO,
                          env=dict(base, NGPU="1", **env), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith("run_train.sh: "), proc.stderr
    assert message in proc.stderr and proc.stdout == ""
    assert not list(tmp_path.iterdir())
