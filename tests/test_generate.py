"""``python -m hymo_recipes.generate`` on a checkpoint that two CPU processes (FSDP2 over gloo)
wrote through run_train.sh: it loads into one process, generates text, greedy runs repeat
exactly, and bad input ends in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
CONFIG = "train_configs/debug_model.toml"
PROMPTS = ("The jury said", "It was")

pytestmark = pytest.mark.slow


def _env() -> dict:
    env = dict(os.environ, NGPU="2", CONFIG_FILE=CONFIG)
    # torchrun and python3 of this interpreter's environment, activated or not
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A dump folder: the debug model after 2 steps of a 2-process run (as tests/integration/test_train.py runs it)."""
    for p in ("data/brown/train.parquet", "assets/tokenizer/tokenizer.json"):
        if not (REPO / p).exists():
            pytest.fail(f"{p} missing: run `python -m hymo_recipes.data.prepare` (or ./scripts/setup.sh) first")
    folder = tmp_path_factory.mktemp("generate_run")
    proc = subprocess.run(["./run_train.sh", "--job.dump_folder", str(folder), "--training.steps", "2",
                           "--checkpoint.interval", "2", "--validation.no-enable", "--metrics.no-enable-tensorboard"],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"run_train.sh failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}"
    assert (folder / "checkpoint" / "step-2" / ".metadata").is_file()
    assert (folder / "checkpoint" / "step-2" / "__1_0.distcp").is_file()  # two ranks wrote shards
    return folder


def generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hymo_recipes.generate", *args], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=300)


def test_greedy_generation_makes_text_and_repeats_exactly(trained):
    args = ["--checkpoint", str(trained), "--greedy", "--max-new-tokens", "12", "--ignore-eos"]
    for p in PROMPTS:
        args += ["--prompt", p]
    first, second = generate(*args), generate(*args)
    for run in (first, second):
        assert run.returncode == 0, run.stderr[-4000:]
    lines = first.stdout.splitlines()
    assert lines[0] == "--- 1/2" and lines[2] == "--- 2/2", first.stdout
    for line, prompt in ((lines[1], PROMPTS[0]), (lines[3], PROMPTS[1])):
        assert line.startswith(prompt) and len(line) > len(prompt) + 1, first.stdout  # text came after the prompt
    assert "tokens/s" in first.stderr and "step-2" in first.stderr
    assert first.stdout == second.stdout


def test_a_hugging_face_export_generates_what_its_checkpoint_does(trained, tmp_path):
    """--checkpoint may name an export_hf folder: the same weights, the same greedy text."""
    from hymo_recipes.export_hf import main as export_main

    export = tmp_path / "hf"
    assert export_main([str(trained), str(export)]) == 0
    args = ["--greedy", "--max-new-tokens", "12", "--ignore-eos", "--prompt", PROMPTS[0]]
    from_dcp, from_hf = generate("--checkpoint", str(trained), *args), generate("--checkpoint", str(export), *args)
    assert from_dcp.returncode == 0 and from_hf.returncode == 0, from_hf.stderr[-4000:]
    assert from_hf.stdout == from_dcp.stdout and len(from_hf.stdout) > len(PROMPTS[0])
    assert f"loaded {export}" in from_hf.stderr
    refused = generate("--checkpoint", str(export), "--step", "2", *args)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.strip() == (f"generate: error: --step goes with a DCP checkpoint; {export} is a Hugging "
                                      "Face export (its config.json names the flavor and shape)")


def test_a_bad_path_fails_in_one_line(tmp_path):
    run = generate("--checkpoint", str(tmp_path / "nothing_here"), "--prompt", "The jury said")
    assert run.returncode == 2
    assert run.stdout == ""
    assert run.stderr.strip().splitlines() == [f"generate: error: no checkpoint at {tmp_path / 'nothing_here'}: "
                                               "the path does not exist"]


def test_the_two_process_checkpoint_loads_whole_in_one_process(trained, tmp_path):
    """Every model entry read by generate's loader equals the one dcp_to_torch_save gathers."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from hymo_recipes.generate import load_model, model_args, read_manifest

    step = trained / "checkpoint" / "step-2"
    name, args = model_args(read_manifest(str(step)), None, 0, str(step))
    assert name == "debugmodel" and args.vocab_size == 8192  # the tokenizer's, from the manifest
    model = load_model(str(step), name, args, torch.device("cpu"), torch.float32)
    dcp_to_torch_save(step, tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)
    state = model.state_dict()
    assert state.keys() <= whole.keys()
    for key, value in state.items():
        assert torch.equal(value, whole[key]), key
    assert any(k.endswith("moe.expert_bias") for k in state)


def _mup_checkpoint(tmp_path: Path):
    """A step folder of a debug model trained with muP (base width 128, half its dim), saved in
    this process with the manifest identity a run with ``--hymo.mup_base_width 128`` records;
    and that model."""
    import dataclasses

    import torch.distributed.checkpoint as dcp

    import hymo_recipes.titan  # noqa: F401  (registers the TrainSpec and the datasets)
    from hymo_recipes.generate import with_backend
    from hymo_recipes.model import HymoModel, hymo_flavors
    from hymo_recipes.titan import checkpoints
    from hymo_recipes.titan.train import parse_config

    config = parse_config(["--job.config_file", str(REPO / CONFIG), "--job.dump_folder", str(tmp_path / "run"),
                           "--hymo.mup_base_width", "128"])
    identity = checkpoints.run_identity(config)
    args = with_backend(dataclasses.replace(hymo_flavors["debugmodel"], vocab_size=8192, mup_base_width=128),
                        torch.device("cpu"))
    torch.manual_seed(0)
    model = HymoModel(args)
    model.init_weights()
    step = tmp_path / "run" / "checkpoint" / "step-1"
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(model.state_dict(), checkpoint_id=str(step))
    (step / checkpoints.MANIFEST).write_text(json.dumps({"format": checkpoints.FORMAT, "step": 1, "identity": identity,
                                                         "files": {}}))
    return step, model.eval()


def test_a_mup_checkpoint_is_rebuilt_with_its_base_width(tmp_path, capsys):
    """muP changes no shape, so a model rebuilt without the checkpoint's base width would load
    and sample from other logits (the readout multiplier base/dim, MLA's softmax scale 1/d)."""
    from hymo_recipes.generate import load_model, main, model_args, read_manifest

    step, trained = _mup_checkpoint(tmp_path)
    name, args = model_args(read_manifest(str(step)), None, 0, str(step))
    assert args.mup_base_width == 128 and args.mup_width_mult == 2.0
    loaded = load_model(str(step), name, args, torch.device("cpu"), torch.float32)
    assert loaded.logit_multiplier == 0.5
    tokens = torch.randint(0, 8192, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = loaded(tokens), trained(tokens)
    torch.testing.assert_close(ours[0], theirs[0], rtol=0, atol=0)
    for a, b in zip(ours[1], theirs[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert main(["--checkpoint", str(step), "--prompt", "The jury said", "--greedy", "--max-new-tokens", "3"]) == 0
    assert "muP base width 128" in capsys.readouterr().err
    # a config that says otherwise is refused in one line
    config = tmp_path / "off.toml"
    config.write_text((REPO / CONFIG).read_text() + "\n[hymo]\nmup_base_width = 0\n")
    assert main(["--checkpoint", str(step), "--config", str(config), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"generate: error: checkpoint {step} was trained with mup_base_width 128, "
                                        "not 0 ([hymo] mup_base_width of --config): drop the setting or set it to 128"]
    # a manifest that does not record the base width was written with muP off
    manifest = json.loads((step / "hymo_manifest.json").read_text())
    del manifest["identity"]["mup_base_width"]
    assert model_args(manifest, None, 0, str(step))[1].mup_base_width == 0


@pytest.mark.parametrize("case", ["flavor", "shape", "empty_prompt", "dump_without_steps"])
def test_bad_input_fails_in_one_line(trained, tmp_path, capsys, case):
    from hymo_recipes.generate import main

    step = trained / "checkpoint" / "step-2"
    if case == "flavor":
        argv, expect = ["--checkpoint", str(trained), "--flavor", "small", "--prompt", "x"], \
            "was trained with flavor 'debugmodel', not 'small'"
    elif case == "shape":  # no manifest to name the flavor: the shapes in .metadata tell
        bare = tmp_path / "step-2"
        bare.mkdir()
        for f in step.iterdir():
            if f.name != "hymo_manifest.json":
                os.symlink(f, bare / f.name)
        argv, expect = ["--checkpoint", str(bare), "--flavor", "750m", "--prompt", "x"], \
            "holds a model of another shape than flavor '750m'"
    elif case == "empty_prompt":
        argv, expect = ["--checkpoint", str(trained), "--prompt", "The jury", "--prompt", " "], "prompt 2 is empty"
    else:
        argv, expect = ["--checkpoint", str(tmp_path), "--prompt", "x"], "no checkpoint at"
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("generate: error: ") and expect in err, err
