"""Checks that run before the Trainer builds anything (preflight.py), and a rank's end when its
launcher dies (train.die_with_launcher)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import hymo_recipes.titan  # noqa: F401  (registers the TrainSpec and the datasets; CPU shim 1 first)
from hymo_recipes.titan import preflight
from hymo_recipes.model import hymo_flavors
from hymo_recipes.titan.train import parse_config

REPO = Path(__file__).resolve().parents[2]
DEBUG = ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml")]


@pytest.mark.parametrize("extra, message", [
    (["--model.flavor", "debugmodle"], "unknown \\[model\\] flavor 'debugmodle': HyMo has debugmodel, small, 750m"),
    (["--training.seq_len", "2"], "training.seq_len = 2 leaves no target for MTP head 2"),
    (["--validation.seq_len", "1"], "validation.seq_len = 1 leaves no target"),
    (["--training.steps", "-1"], "training.steps must be a positive whole number of steps, got -1"),
    (["--lr_scheduler.total_steps", "0"], "lr_scheduler.total_steps must be a positive whole number"),
    (["--lr_scheduler.warmup_fraction", "0.5"], "WSD fractions must sum to 1"),
    (["--compile.enable"], "kept out of torch.compile"),
    (["--training.local_batch_size", "0"], "training.local_batch_size must be at least 1, got 0"),
    (["--checkpoint.interval", "0"], "checkpoint.interval must be at least 1"),
    (["--validation.dataset_path", "/nonexistent/data"],
     "\\[validation\\] dataset: dataset path '/nonexistent/data' does not exist: check dataset_path"),
    (["--training.dataset", "local"], "\\[training\\] dataset: dataset 'local' needs dataset_path"),
], ids=["flavor", "seq-len-mtp", "validation-seq-len-mtp", "steps", "total-steps", "fractions", "compile",
        "local-batch", "checkpoint-interval", "validation-data", "local-without-path"])
def test_bad_settings_fail_in_one_line_before_the_trainer(extra, message):
    with pytest.raises(SystemExit, match=f"hymo: invalid job config .*{message}"):
        parse_config(DEBUG + extra)


def test_values_of_the_wrong_type_name_the_field(tmp_path):
    text = (REPO / "train_configs" / "debug_model.toml").read_text()
    for old, new, message in [("steps = 60", 'steps = "60"', "training.steps = '60' \\(str\\) does not fit its type int"),
                              ("seq_len = 256", "seq_len = true", "training.seq_len = True \\(bool\\)")]:
        assert old in text
        path = tmp_path / "typed.toml"
        path.write_text(text.replace(old, new, 1))
        with pytest.raises(SystemExit, match=message):
            parse_config(["--job.config_file", str(path)])


def test_the_configs_pass_and_a_float_field_takes_an_int(tmp_path, monkeypatch):
    # what a config asks of the machine's GPU (a CUDA-graphed optimizer step, NorMuon's kernels)
    # is not this machine's to give; the config's own values are checked
    for name in ("check_optimizer_graph", "check_normuon_fused"):
        check = getattr(preflight, name)
        monkeypatch.setattr(preflight, name, lambda cfg, installed=True, _check=check, **kw: _check(cfg, **kw,
                                                                                                   installed=False))
    for toml in sorted((REPO / "train_configs").glob("*.toml")):
        parse_config(["--job.config_file", str(toml)])  # the tests run the Triton backend in the interpreter
    config = parse_config(DEBUG + ["--optimizer.lr", "1"])
    assert config.optimizer.lr == 1


def test_triton_backend_that_cannot_run_fails_before_the_trainer(monkeypatch):
    from hymo_kernels.gdn import chunk

    monkeypatch.setattr(chunk, "unavailable", lambda device_type: f"needs CUDA tensors (got {device_type})")
    small = ["--job.config_file", str(REPO / "train_configs" / "hymo_small.toml")]
    with pytest.raises(SystemExit, match='gdn_backend "triton" needs CUDA tensors.*--hymo.gdn_backend torch_chunk'
                                         ".* and --optimizer.no-cuda_graph and --optimizer.no-normuon_fused\\)"):
        parse_config(small)  # the config graphs its optimizer step and runs NorMuon's kernels
    with pytest.raises(SystemExit, match='gdn_backend "triton" needs'):
        parse_config(DEBUG + ["--hymo.gdn_backend", "triton"])
    parse_config(small + ["--hymo.gdn_backend", "torch_chunk", "--compile.no-enable", "--optimizer.no-cuda_graph",
                          "--optimizer.no-normuon_fused"])


def test_flash_attention_backend_is_checked_before_the_trainer(monkeypatch):
    """BACKEND=FLASH needs flash-attn-4's kernels importable (on this machine) and a run that is
    not deterministic (on any); without it the options are not looked at."""
    import types

    flash = DEBUG + ["--hymo.mla_flex_options", "BACKEND=FLASH", "--debug.no-deterministic"]
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # import flash_attn.cute raises ImportError
    with pytest.raises(SystemExit, match=r"hymo: invalid job config.*BACKEND=FLASH runs flash-attn-4's kernels, which "
                                         r'do not import here \(\w*Error: .*\): pip install -e "\.\[flash\]"'):
        parse_config(flash)
    preflight.check_flash_attention("BACKEND=FLASH", False, installed=False)  # the config check, another machine
    parse_config(DEBUG + ["--hymo.mla_flex_options", "bwd_num_stages=2"])  # another backend needs nothing
    parent = types.ModuleType("flash_attn")
    parent.cute = types.ModuleType("flash_attn.cute")
    monkeypatch.setitem(sys.modules, "flash_attn", parent)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", parent.cute)
    assert parse_config(flash).hymo.mla_flex_options == "BACKEND=FLASH"
    with pytest.raises(SystemExit, match="BACKEND=FLASH has no deterministic backward.*debug.deterministic"):
        parse_config(flash[:-1])  # the debug model's config is deterministic
    with pytest.raises(ValueError, match="no deterministic backward"):
        preflight.check_flash_attention("BACKEND=FLASH", True, installed=False)


def test_optimizer_cuda_graph_is_checked_before_the_trainer(monkeypatch):
    """optimizer.cuda_graph needs a CUDA machine (here: none), one rank and HyMo's optimizers
    (compiled or not); off, nothing is looked at."""
    import types

    monkeypatch.setattr(preflight.torch.cuda, "is_available", lambda: False)  # this machine, GPU or not
    with pytest.raises(SystemExit, match="hymo: invalid job config.*optimizer.cuda_graph needs a CUDA GPU and this "
                                         "machine has none"):
        parse_config(DEBUG + ["--optimizer.cuda_graph"])
    ok = types.SimpleNamespace(cuda_graph=True, name="NorMuon", normuon_compiled=False)
    preflight.check_optimizer_graph(ok, installed=False)  # the config check, another machine
    preflight.check_optimizer_graph(types.SimpleNamespace(cuda_graph=False, name="AdamW"))
    with pytest.raises(ValueError, match=r'name = "AdamW" \(torch\'s\) is not graphed'):
        preflight.check_optimizer_graph(types.SimpleNamespace(**{**vars(ok), "name": "AdamW"}), installed=False)
    preflight.check_optimizer_graph(types.SimpleNamespace(**{**vars(ok), "normuon_compiled": True}), installed=False)
    with pytest.raises(ValueError, match="enable_cpu_offload keeps the parameters on the CPU"):
        preflight.check_optimizer_graph(ok, installed=False, cpu_offload=True)
    preflight.check_optimizer_graph(types.SimpleNamespace(**{**vars(ok), "cuda_graph_streams": 3}), installed=False)
    with pytest.raises(SystemExit, match=r"cuda_graph_streams must be an integer >= 1 .*got 0"):
        parse_config(DEBUG + ["--optimizer.cuda_graph_streams", "0"])
    # without the graph the streams have nothing to spread: a config that sets them (as
    # hymo_small.toml does) still runs with --optimizer.no-cuda_graph
    assert parse_config(DEBUG + ["--optimizer.cuda_graph_streams", "2"]).optimizer.cuda_graph_streams == 2
    with pytest.raises(SystemExit, match=r"cuda_graph_streams must be an integer >= 1 .*got 0"):
        parse_config(DEBUG + ["--optimizer.no-cuda_graph", "--optimizer.cuda_graph_streams", "0"])
    with pytest.raises(ValueError, match="runs on one rank only .*this run has 4"):
        preflight.check_optimizer_graph(ok, installed=False, processes=4)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="runs on one rank only .*this run has 2"):
        preflight.check_optimizer_graph(ok, installed=False)
    # a fake comm mode's processes are NGPU's, which the config check counts
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("NGPU", "2")
    monkeypatch.setattr(preflight.torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit, match="runs on one rank only .*this run has 2"):
        parse_config(DEBUG + ["--optimizer.cuda_graph", "--comm.mode", "fake_backend"])


def test_normuon_fused_is_checked_before_the_trainer(monkeypatch):
    """optimizer.normuon_fused needs a CUDA machine (here: none), not with normuon_compiled, an
    fp64 orthogonalisation or CPU offload; off, nothing is looked at."""
    import types

    monkeypatch.setattr(preflight.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="hymo: invalid job config.*optimizer.normuon_fused runs Triton kernels on a "
                                         "CUDA GPU and this machine has none: turn it off"):
        parse_config(DEBUG + ["--optimizer.normuon_fused"])
    with pytest.raises(SystemExit, match="normuon_fused and normuon_compiled are two ways"):
        parse_config(DEBUG + ["--optimizer.normuon_fused", "--optimizer.normuon_compiled"])
    ok = types.SimpleNamespace(normuon_fused=True, normuon_compiled=False, normuon_ortho_dtype="bfloat16")
    preflight.check_normuon_fused(ok, installed=False)  # the config check, another machine
    preflight.check_normuon_fused(types.SimpleNamespace(normuon_fused=False, normuon_compiled=True))
    with pytest.raises(ValueError, match="not float64"):
        preflight.check_normuon_fused(types.SimpleNamespace(**{**vars(ok), "normuon_ortho_dtype": "float64"}),
                                      installed=False)
    with pytest.raises(ValueError, match="enable_cpu_offload keeps the parameters on the CPU"):
        preflight.check_normuon_fused(ok, installed=False, cpu_offload=True)


def test_rope_table_reaches_the_validation_length():
    config = parse_config(DEBUG + ["--training.seq_len", "100"])
    assert config.validation.enable and config.validation.seq_len == 256
    args = hymo_flavors["debugmodel"].__class__(**vars(hymo_flavors["debugmodel"]))
    args.update_from_config(config)
    assert args.max_seq_len == 256
    config.validation.enable = False
    args.update_from_config(config)
    assert args.max_seq_len == 100


def _save(folder: Path, step: int) -> Path:
    path = folder / f"step-{step}"
    dcp.save({"w": torch.arange(4096.0) + step, "b": torch.ones(64)}, checkpoint_id=str(path))
    return path


@pytest.fixture
def run_dir(tmp_path):
    folder = tmp_path / "out" / "checkpoint"
    _save(folder, 2)
    newest = _save(folder, 4)
    config = parse_config(DEBUG + ["--job.dump_folder", str(tmp_path / "out")])
    return config, folder, newest


def _spy_checks(monkeypatch) -> list:
    checked = []
    real = preflight.check_dcp_checkpoint
    monkeypatch.setattr(preflight, "check_dcp_checkpoint",
                        lambda path, earlier=(): (checked.append((Path(path).name, list(earlier))), real(path, earlier)))
    return checked


def test_whole_checkpoints_pass_and_the_newest_is_checked(run_dir, monkeypatch):
    config, _, _ = run_dir
    checked = _spy_checks(monkeypatch)
    preflight.check_checkpoint_to_load(config)
    assert checked == [("step-4", [2])]
    config.checkpoint.load_step = 2
    preflight.check_checkpoint_to_load(config)
    assert checked[-1] == ("step-2", [])


@pytest.mark.parametrize("damage, message", [
    ("truncate", "shard __0_0.distcp has [0-9,]+ bytes where its metadata needs"),
    ("delete", "shard __0_0.distcp is missing"),
    ("metadata", "its .metadata cannot be read"),
])
def test_damaged_newest_checkpoint_names_itself_and_the_earlier_step(run_dir, damage, message):
    config, folder, newest = run_dir
    shard = newest / "__0_0.distcp"
    if damage == "truncate":
        os.truncate(shard, shard.stat().st_size // 2)
    elif damage == "delete":
        shard.unlink()
    else:
        os.truncate(newest / ".metadata", 10)
    with pytest.raises(ValueError, match=f"checkpoint .*step-4 is damaged: {message}.*--checkpoint.load_step 2"):
        preflight.check_checkpoint_to_load(config)
    # the same through the entry point: one line, before the Trainer
    with pytest.raises(SystemExit, match="hymo: invalid job config .*step-4 is damaged"):
        parse_config(DEBUG + ["--job.dump_folder", str(folder.parent)])
    config.checkpoint.load_step = 2  # resuming from the whole one is fine
    preflight.check_checkpoint_to_load(config)


def test_unfinished_save_is_skipped_with_a_warning(run_dir, caplog, monkeypatch):
    config, folder, _ = run_dir
    checked = _spy_checks(monkeypatch)
    unfinished = _save(folder, 6)
    (unfinished / ".metadata").unlink()
    os.truncate(unfinished / "__0_0.distcp", 10)
    with caplog.at_level("WARNING"):
        preflight.check_checkpoint_to_load(config)  # step-4 is the one loaded, and it is whole
    assert "step-6 in" in caplog.text and "resuming from step-4" in caplog.text
    assert checked == [("step-4", [2])]
    caplog.clear()
    (unfinished / "model.safetensors.index.json").write_text("{}")  # an HF export counts as whole
    with caplog.at_level("WARNING"):
        preflight.check_checkpoint_to_load(config)
    assert "skipped" not in caplog.text and "resuming from step-6" in caplog.text  # unchecked: no manifest
    assert checked == [("step-4", [2])]  # step-6 is TorchTitan's to load now, and has no DCP metadata to check


_LAUNCHER = """
import os, subprocess, sys, time
env = dict(os.environ)
if sys.argv[1] == "torchrun":
    env["TORCHELASTIC_RUN_ID"] = "test"
else:
    env.pop("TORCHELASTIC_RUN_ID", None)
child = subprocess.Popen([sys.executable, "-c",
    "import time; from hymo_recipes.titan.train import die_with_launcher; die_with_launcher(); print('armed', flush=True); time.sleep(60)"],
    env=env, start_new_session=True, stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "armed"
print(child.pid, flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[-1][0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
@pytest.mark.parametrize("launcher", ["torchrun", "other"])
def test_rank_ends_when_its_launcher_is_killed(launcher):
    p = subprocess.Popen([sys.executable, "-c", _LAUNCHER, launcher], stdout=subprocess.PIPE, text=True)
    child = int(p.stdout.readline())
    try:
        p.send_signal(signal.SIGKILL)
        p.wait()
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        # under torchrun the rank dies with its launcher; elsewhere it is not touched
        assert _alive(child) == (launcher == "other")
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def test_document_masking_is_refused_for_a_model_other_than_hymo(tmp_path):
    toml = tmp_path / "llama.toml"
    toml.write_text('[model]\nname = "llama3"\nflavor = "debugmodel"\nhf_assets_path = "./assets/tokenizer"\n'
                    '[training]\ndataset = "brown"\n')
    with pytest.raises(SystemExit, match="document_masking is for HyMo models: model.name = 'llama3'.*"
                                         "--hymo.no-document_masking"):
        parse_config(["--job.config_file", str(toml)])
    config = parse_config(["--job.config_file", str(toml), "--hymo.no-document_masking"])
    assert config.model.name == "llama3" and not config.hymo.document_masking
    with pytest.raises(SystemExit, match="document_masking is for HyMo models"):  # the held-out loss asks for it
        parse_config(["--job.config_file", str(toml), "--hymo.no-document_masking",
                      "--hymo.validation_document_masking", "on"])


def test_the_train_benchs_peer_configs_pass_the_config_check(tmp_path, monkeypatch):
    """benchmarks/train_bench.py trains TorchTitan's own models through HyMo's trainer: their
    generated configs must pass the same check (document masking off: their forwards take no
    document boundaries)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))  # benchmarks/, also when run alone
    from benchmarks import train_bench

    peers = {p["model"] for p in train_bench.PRESETS.values() if "model" in p}
    assert {("deepseek_v3", "hymo_mla32"), ("llama3", "450m")} <= peers
    for model, flavor in sorted(peers):
        toml = tmp_path / f"{model}_{flavor}.toml"
        toml.write_text(train_bench._PEER_TOML.format(model=model, flavor=flavor, compile="false"))
        config = parse_config(["--job.config_file", str(toml), "--experimental.custom_import", "benchmarks.peers"])
        assert (config.model.name, config.model.flavor) == (model, flavor)
        assert not config.hymo.document_masking
