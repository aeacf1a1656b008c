"""Bad input stops a run before anything is built, in one line that names the file or setting
and what to do; through ./run_train.sh that line comes without torchrun's failure report."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEBUG = ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml")]
BROWN = REPO / "data" / "brown"


def parse(*extra, **kw):
    """parse_config of the debug config into a fresh dump folder (none to resume from)."""
    from hymo_recipes.titan.train import parse_config

    return parse_config(DEBUG + ["--job.dump_folder", tempfile.mkdtemp()] + [str(a) for a in extra], **kw)


def one_line_error(*extra) -> str:
    with pytest.raises(SystemExit) as e:
        parse(*extra)
    message = str(e.value)
    assert message.startswith("hymo: invalid job config") and "\n" not in message
    return message


@pytest.fixture
def data(tmp_path):
    """Bad local data: empty files, a folder without a train split, a one-document file,
    undecodable text."""
    (tmp_path / "empty.jsonl").write_bytes(b"")
    (tmp_path / "only_validation").mkdir()
    shutil.copy(BROWN / "validation.parquet", tmp_path / "only_validation")
    (tmp_path / "tiny.jsonl").write_text('{"text": "one short document"}\n')
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    return tmp_path


@pytest.mark.parametrize("extra, message", [
    (["--training.dataset", "local", "--training.dataset_path", "{d}/empty.jsonl"],
     "[training] dataset: {d}/empty.jsonl is empty: put documents in it"),
    (["--validation.dataset", "local_validation", "--validation.dataset_path", "{d}/empty.jsonl"],
     "[validation] dataset: {d}/empty.jsonl is empty"),
    (["--training.dataset", "local", "--training.dataset_path", "{d}/only_validation"],
     "has validation.parquet but no train.<ext>: add train.<ext>"),
    (["--training.dataset", "local", "--training.dataset_path", "{d}/tiny.jsonl"],
     "{d}/tiny.jsonl is too small: it holds 5 tokens (0 windows of 257), the run (60 steps) reads 240 windows"),
    (["--validation.dataset", "local_validation", "--validation.dataset_path", "{d}/tiny.jsonl"],
     "[validation] dataset: {d}/tiny.jsonl is too small"),
    (["--training.dataset", "local", "--training.dataset_path", "{d}/latin1.txt"],
     "{d}/latin1.txt is not valid UTF-8 (byte 3: invalid continuation byte): re-encode it"),
], ids=["empty-train", "empty-validation", "no-train-split", "smaller-than-the-run", "validation-smaller-than-a-batch",
        "bad-utf8"])
def test_bad_data_fails_in_one_line_naming_the_file(data, extra, message):
    assert message.format(d=data) in one_line_error(*(a.format(d=data) for a in extra))


def test_data_repeat_only_when_asked_and_with_one_warning(data, caplog):
    tiny = ["--training.dataset", "local", "--training.dataset_path", data / "tiny.jsonl"]
    assert "--hymo.allow_data_repeat to loop over it" in one_line_error(*tiny)
    with caplog.at_level(logging.WARNING):
        config = parse(*tiny, "--hymo.allow_data_repeat")
    assert config.hymo.allow_data_repeat
    assert [r.getMessage() for r in caplog.records if "looping over it" in r.getMessage()] == [
        f"[training] dataset: {data}/tiny.jsonl is smaller than the run (60 steps) reads (it holds 5 tokens, "
        "61,680 read): looping over it (less than one window; hymo.allow_data_repeat)"]


def test_a_rank_with_no_document_is_an_error_even_when_looping(data, monkeypatch):
    """One document for two data-parallel ranks: one shard is empty, and looping over it would
    yield nothing; the check says so before anything is built, whatever allow_data_repeat says."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    tiny = ["--training.dataset", "local", "--training.dataset_path", data / "tiny.jsonl"]
    for extra in ([], ["--hymo.allow_data_repeat"]):
        assert (f"{data}/tiny.jsonl is too small: the smallest of 2 ranks' shards holds no tokens (1 documents for "
                "2 data-parallel ranks): use more data or fewer ranks") in one_line_error(*tiny, *extra)


def test_the_dataloader_loops_only_when_asked(data, caplog):
    from hymo_recipes.titan.datasets import build_tokenizer
    from hymo_recipes.titan.dataloader import HymoTextDataset

    config = parse()
    tokenizer = build_tokenizer(config)
    kw = dict(dataset_name="local", dataset_path=str(data / "tiny.jsonl"), tokenizer=tokenizer, seq_len=16,
              infinite=True)
    with pytest.raises(RuntimeError, match="ran out of data after one pass.*--hymo.allow_data_repeat"):
        next(iter(HymoTextDataset(**kw)))
    it = iter(HymoTextDataset(**kw, allow_repeat=True))
    with caplog.at_level(logging.WARNING):
        windows = [next(it)[1] for _ in range(5)]  # 5 tokens a pass
    assert all(w.shape == (16,) for w in windows)
    assert sum("re-looped" in r.getMessage() for r in caplog.records) == 1


def test_a_corrupt_tokenizer_names_its_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text((REPO / "assets/tokenizer/tokenizer.json").read_text()[:1000])
    shutil.copy(REPO / "assets/tokenizer/tokenizer_config.json", tmp_path)
    message = one_line_error("--model.hf_assets_path", tmp_path)
    assert f"{tmp_path}/tokenizer.json (model.hf_assets_path) is not valid JSON (" in message
    assert "point [model] hf_assets_path at a directory with a valid tokenizer.json" in message


@pytest.mark.parametrize("extra, message", [
    (["--optimizer.lr", "-0.001"], "optimizer.lr = -0.001 must be a finite number, at least 0"),
    (["--optimizer.normuon_lr", "-1"], "optimizer.normuon_lr = -1.0 must be a finite number, at least 0"),
    (["--optimizer.beta2", "1.5"], "optimizer.beta2 = 1.5 must be in [0, 1)"),
    (["--optimizer.name", "Adam"], "invalid choice 'Adam' for argument '--optimizer.name'. Expected one of "
                                   "('NorMuon', 'CautiousAdamW', 'AdamW')."),
    (["--training.nonsense", "1"], "Unrecognized options: --training.nonsense, 1 (python -m hymo_recipes.train "
                                   "--help lists every option)"),
    (["--training.steps", "many"], "Error parsing --training.steps: invalid literal for int()"),
    (["--checkpoint.last_save_model_only=maybe"], "--checkpoint.last_save_model_only takes true or false (or write "
                                                  "--checkpoint.last_save_model_only / --checkpoint.no-last_save_model_only)"),
    (["--training.global_batch_size", "10"], "training.global_batch_size 10 is not a multiple of "
                                             "training.local_batch_size 4 × 1 data-parallel ranks = 4"),
], ids=["negative-lr", "negative-normuon-lr", "beta2", "unknown-optimizer", "unknown-flag", "not-an-int",
        "bool-value", "batch"])
def test_bad_settings_fail_in_one_line(extra, message):
    assert message in one_line_error(*extra)


def test_unknown_optimizer_in_a_toml(tmp_path):
    toml = (REPO / "train_configs/debug_model.toml").read_text()
    assert "\n[optimizer]\n" not in toml  # the debug config keeps HyMo's optimizer defaults
    toml += '\n[optimizer]\nname = "Adam"\n'
    (tmp_path / "c.toml").write_text(toml)
    from hymo_recipes.titan.train import parse_config

    with pytest.raises(SystemExit, match="optimizer.name = 'Adam'"):
        parse_config(["--job.config_file", str(tmp_path / "c.toml")])


def test_batch_must_divide_over_the_processes(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "12 is not a multiple of training.local_batch_size 4 × 2 data-parallel ranks = 8" in one_line_error(
        "--training.global_batch_size", "12")
    assert parse("--training.global_batch_size", "16").training.global_batch_size == 16


@pytest.mark.parametrize("written, value", [("=false", False), ("=False", False), (" false", False), ("=true", True),
                                            ("=1", True), ("=no", False)])
def test_a_boolean_written_with_a_value_is_understood(written, value):
    config = parse(*f"--checkpoint.last_save_model_only{written}".split())
    assert config.checkpoint.last_save_model_only is value


def test_schedule_jump_on_resume_warns_once_with_the_flag_that_keeps_it(tmp_path, caplog):
    """A finished 60-step run (its lr at the end of the decay) extended to 120 steps."""
    import torch.distributed.checkpoint as dcp

    from hymo_recipes.scheduler import make_wsd_lambda, wsd_schedule
    from hymo_recipes.titan.resume_schedule import check_schedule_continues

    config = parse()
    factor = make_wsd_lambda(wsd_schedule(config.lr_scheduler, 60))(60)
    state = {"lr_scheduler": {"normuon": {"last_epoch": 60, "_last_lr": [0.02 * factor], "base_lrs": [0.02]}}}
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    with caplog.at_level(logging.WARNING):
        check_schedule_continues(config, str(tmp_path))  # same total: nothing said
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        config = parse("--training.steps", "120")
        check_schedule_continues(config, str(tmp_path))
    (record,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert ("resuming at step 61 with a schedule of 120 steps changes the learning rate there from 0.05 to 1 × the "
            "peak" in record.getMessage())
    assert record.getMessage().endswith("pass --lr_scheduler.total_steps 60")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        check_schedule_continues(parse("--training.steps", "120", "--lr_scheduler.total_steps", "60"), str(tmp_path))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# ---- through ./run_train.sh: the launcher's output ---------------------------------------------------------------
def run_train(*args, env=None, cwd=REPO, script=REPO / "run_train.sh"):
    env = env or dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = subprocess.run([str(script), *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("extra, message", [
    (["--training.nonsense", "1"], "Unrecognized options: --training.nonsense, 1"),
    (["--optimizer.lr", "-0.001"], "optimizer.lr = -0.001 must be a finite number, at least 0"),
    (["--optimizer.name", "Adam"], "invalid choice 'Adam' for argument '--optimizer.name'"),
    (["--training.global_batch_size", "12"], "12 is not a multiple of training.local_batch_size 4 × 2 data-parallel "
                                             "ranks = 8"),
    (["--training.dataset", "local", "--training.dataset_path", "{d}/empty.jsonl"], "{d}/empty.jsonl is empty"),
    (["--model.hf_assets_path", "{d}/tok"], "{d}/tok/tokenizer.json (model.hf_assets_path) is not valid JSON"),
], ids=["unknown-flag", "negative-lr", "unknown-optimizer", "batch-over-2-processes", "empty-data", "corrupt-tokenizer"])
def test_run_train_sh_says_it_in_one_line_without_torchruns_report(data, extra, message):
    (data / "tok").mkdir()
    (data / "tok" / "tokenizer.json").write_text("{")
    rc, out = run_train("--job.dump_folder", data / "run", *(a.format(d=data) for a in extra),
                        env=dict(os.environ, NGPU="2", PATH=f"{Path(sys.executable).parent}{os.pathsep}"
                                                            f"{os.environ.get('PATH', '')}"))
    assert rc == 1, out[-4000:]
    lines = [line for line in out.splitlines() if "hymo: invalid job config" in line]
    assert len(lines) == 1 and message.format(d=data) in lines[0], out[-4000:]
    for report in ("ChildFailedError", "Traceback", "Root Cause", "╭─"):
        assert report not in out, out[-4000:]
    assert not (data / "run" / "checkpoint").exists() and not (data / "run" / "tb").exists()  # nothing trained


def test_run_train_sh_uses_the_repositorys_venv_or_says_how_to_make_one(tmp_path):
    # The case needs a repository .venv (setup.sh and .ci/run make one) and a system python3
    # without torch (the shell a user forgot to activate); where either is missing there is no
    # such shell to test, so the test says so instead of passing.
    venv = REPO / ".venv" / "bin" / "python3"
    if not venv.exists():
        pytest.skip("no .venv in this checkout")
    bare = {"HOME": os.environ.get("HOME", "/tmp"), "PATH": "/usr/bin:/bin"}
    probe = subprocess.run(["python3", "-c", "import torch"], env=bare, capture_output=True)
    if probe.returncode == 0:
        pytest.skip("the system python3 has torch")
    rc, out = run_train("--optimizer.lr", "-1", env=bare)  # stops at the preflight, through the .venv
    assert rc == 1 and f"lacks torch or hymo_recipes; using {REPO}/.venv" in out, out[-4000:]
    assert "optimizer.lr = -1.0 must be" in out and "ModuleNotFoundError" not in out, out[-4000:]
    shutil.copy(REPO / "run_train.sh", tmp_path)  # a copy with no .venv beside it
    rc, out = run_train(env=bare, cwd=tmp_path, script=tmp_path / "run_train.sh")
    assert rc == 1 and out.strip().splitlines() == [
        "run_train.sh: python3 (/usr/bin/python3) cannot import torch and hymo_recipes, and there is no usable .venv: "
        "run ./scripts/setup.sh, then . .venv/bin/activate"], out


@pytest.mark.parametrize("policy, dp, units, accumulation, kept_all, sums", [
    ("default", 1, "block", 1, True, False), ("default", 2, "block", 1, False, False),
    ("always", 1, "block", 1, False, False), ("never", 2, "block", 1, True, False),
    ("always", 1, "auto", 1, True, False),  # auto on one rank: the root alone, everything gathered
    ("always", 1, "auto", 2, True, True),  # ... and with accumulation the unsharded gradient sums
    ("default", 2, "auto", 2, False, False),
    ("default", 2, "block-once", 2, True, True)])  # reduced once per step: every unit stays gathered
def test_check_counts_the_gathered_parameters_fsdp_keeps(policy, dp, units, accumulation, kept_all, sums):
    """Resharding after the forward, FSDP holds two gathered blocks; without it (one rank, by
    default) every block's gathered copy stays until the backward; one unit gathers everything;
    gradients reduced once per step are summed unsharded in fp32: the estimate counts each."""
    from types import SimpleNamespace

    import torch

    from hymo_recipes.model import HymoModel, hymo_flavors
    from hymo_recipes.titan.check import memory_lines

    with torch.device("meta"):
        model = HymoModel(hymo_flavors["debugmodel"])
    config = SimpleNamespace(training=SimpleNamespace(mixed_precision_param="bfloat16", mixed_precision_reduce="float32",
                                                      local_batch_size=1, seq_len=64,
                                                      global_batch_size=dp * accumulation),
                             parallelism=SimpleNamespace(fsdp_reshard_after_forward=policy),
                             activation_checkpoint=SimpleNamespace(mode="none"),
                             hymo=SimpleNamespace(fsdp_units=units.removesuffix("-once"),
                                                  fsdp_sync_once_per_step=units.endswith("-once")))
    line, _activations = memory_lines(model, {}, config, dp)
    n = sum(p.numel() for p in model.parameters())
    block = max(sum(p.numel() for p in layer.parameters()) for layer in model.layers.values())
    gathered = n * 2 if kept_all else 2 * block * 2
    label = "gathered copies kept for the backward" if kept_all else "all-gathered blocks"
    assert f"{label} {gathered / (1 << 20):.1f} MiB (bfloat16)" in line, line
    assert (f"unsharded gradient sums {n * 4 / (1 << 20):.1f} MiB (float32)" in line) == sums, line
    total = (2 * n * 4) / dp + gathered + (n * 4 if sums else 0)
    assert f"{total / (1 << 20):.1f} MiB in all" in line, line
    assert "gradient copy" not in line, line
    if dp == 1:  # optimizer.cuda_graph: a static copy of the (fp32) gradients besides them
        config.optimizer = SimpleNamespace(cuda_graph=True)
        line, _activations = memory_lines(model, {}, config, dp)
        assert f"the CUDA-graphed optimizer step's gradient copy {n * 4 / (1 << 20):.1f} MiB" in line, line
        assert f"{(total + n * 4) / (1 << 20):.1f} MiB in all" in line, line
        # an optimizer that reads its gradients by address (NorMuon's fused kernels): no copy of them
        by_address = [p for p in model.parameters() if p.ndim >= 2]
        rest = n - sum(p.numel() for p in by_address)
        fused = SimpleNamespace(state={}, grads_by_address=lambda: by_address)
        line, _activations = memory_lines(model, {"normuon": fused}, config, dp)
        assert f"the CUDA-graphed optimizer step's gradient copy {rest * 4 / (1 << 20):.1f} MiB" in line, line


def test_check_mode_passes_the_750m_config_on_a_cpu_in_little_memory(tmp_path):
    """CHECK=1: preflight, meta model, optimizer partition, memory per GPU at NGPU=8; no step."""
    env = dict(os.environ, CHECK="1", NGPU="8", CONFIG_FILE="train_configs/hymo_750m.toml",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = subprocess.run(["/usr/bin/time", "-f", "maxrss_kb=%M", "./run_train.sh", "--job.dump_folder", str(tmp_path / "x")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    # the MoE on NorMuon (the default): every matrix but the embedding; NorMuon keeps one fp32
    # momentum per parameter (and per-row second moments), CautiousAdamW two
    assert "HyMo optimizers (hymo_recipes/optim/partition.py): normuon 1012.01 M in 268 tensors; cautious_adamw " \
           "7.75 M in 204 tensors" in out
    assert ("HyMo memory per GPU at 8 data-parallel rank(s) (FSDP2, sharded): parameters 0.47 GiB, gradients 0.47 GiB, "
            "optimizer states 0.48 GiB") in out
    assert "hymo check: train_configs/hymo_750m.toml passed at 8 process(es)" in out
    assert int(out.rsplit("maxrss_kb=", 1)[1].split()[0]) < 4 << 20
    assert not (tmp_path / "x").exists()
    env["NGPU"] = "3"  # 128 sequences do not split over 3 ranks of 8
    proc = subprocess.run(["./run_train.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "is not a multiple of training.local_batch_size 8 × 3 data-parallel" in proc.stderr


def test_unknown_fsdp_units_is_one_line_before_the_model():
    assert "[hymo] fsdp_units = 'layer': one of auto, block, model" in one_line_error("--hymo.fsdp_units", "layer")


def test_unknown_validation_document_masking_is_one_line_before_the_model():
    assert ("[hymo] validation_document_masking = 'yes': one of auto, on, off"
            in one_line_error("--hymo.validation_document_masking", "yes"))
