"""Hugging Face export and import (hymo_recipes/export_hf.py, import_hf.py, hymo_recipes/hf/).

- The HF model (modeling_hymo.py, loaded by transformers with trust_remote_code) computes HyMo's
  logits, MTP heads' and muP's logit multiplier included, on batches with left padding too, and
  greedy ``generate()`` gives the tokens HyMo's own decoder and ``hymo_recipes.generate`` give.
- export -> import -> export is bitwise, on a checkpoint two processes wrote in training.
- An imported checkpoint resumes training (the run loads it as its step 0), and TorchTitan's
  ``--checkpoint.last_save_in_hf`` writes the weights through HyMo's state-dict adapter; that folder
  exports to a loadable model.
- lm-eval's ``hf`` model runs the local Brown tasks (evals/brown) on an export, offline, and scores
  the cloze as HyMo's own forward does.
- Bad input ends in one line.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hymo_recipes import export_hf, import_hf
from hymo_recipes.hf import names
from hymo_recipes.model import HymoModel, hymo_flavors
from hymo_recipes.model.decode import HymoDecoder

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "assets" / "tokenizer"
CONFIG = "train_configs/debug_model.toml"
TOL = dict(rtol=1e-5, atol=1e-5)  # fp32; the two implementations sum in other orders


@pytest.fixture(scope="module", autouse=True)
def prepared():
    if not (TOKENIZER / "tokenizer.json").is_file():
        pytest.fail("assets/tokenizer missing: run `python -m hymo_recipes.data.prepare` (or ./scripts/setup.sh) first")


def _tokenizer():
    from hymo_recipes.titan.datasets import load_tokenizer

    return load_tokenizer(str(TOKENIZER))


def debug_args(**overrides):
    """The debug flavor at the tokenizer's vocabulary (as a run builds it), with `overrides`."""
    return dataclasses.replace(copy.deepcopy(hymo_flavors["debugmodel"]), vocab_size=8192, **overrides)


def random_model(args, seed: int = 0) -> HymoModel:
    """An initialised model whose every tensor is off its init value (norms not 1, a MoE selection bias
    that changes routing), so that a tensor the export drops or swaps changes the logits."""
    torch.manual_seed(seed)
    model = HymoModel(args)
    model.init_weights()
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("expert_bias"):
                t.copy_(torch.randn_like(t) * 0.05)
            elif name.endswith("load_ema"):
                t.copy_(torch.rand_like(t) / t.numel())
            elif "norm" in name:
                t.mul_(1 + 0.2 * torch.randn_like(t))
    return model.eval()


def dropless(model: HymoModel) -> HymoModel:
    """HyMo's inference MoE: no capacity dropping (decode.py); the HF model is dropless too."""
    model = copy.deepcopy(model)
    for layer in model.layers.values():
        if getattr(layer, "moe", None) is not None:
            layer.moe.capacity_factor = 0
    return model


def hf_model(model: HymoModel, flavor: str = "debugmodel"):
    """The HF model (this repository's modeling_hymo.py) with `model`'s weights, built in-process."""
    from hymo_recipes.hf.configuration_hymo import HymoConfig
    from hymo_recipes.hf.modeling_hymo import HymoForCausalLM
    from hymo_recipes.titan.checkpoints import tokenizer_identity

    tok = _tokenizer()
    config = export_hf.hf_config(model.model_args, flavor, tokenizer_identity(str(TOKENIZER)), tok.bos_id, tok.eos_id)
    hf = HymoForCausalLM(HymoConfig(**{k: v for k, v in config.items() if k not in ("architectures", "auto_map")}))
    missing, unexpected = hf.load_state_dict(names.to_hf(model.state_dict()), strict=True)
    assert not missing and not unexpected
    return hf.eval()


def make_checkpoint(folder: Path, model: HymoModel, flavor: str = "debugmodel") -> Path:
    """A model-only DCP step folder with a HyMo manifest (import_hf's writer)."""
    from hymo_recipes.titan.checkpoints import tokenizer_identity

    step = folder / "checkpoint" / "step-0"
    import_hf.write_checkpoint(str(step), model.state_dict(), flavor, model.model_args,
                               tokenizer_identity(str(TOKENIZER)))
    return step


def export(*argv) -> None:
    assert export_hf.main([str(a) for a in argv]) == 0


def import_(*argv) -> None:
    assert import_hf.main([str(a) for a in argv]) == 0


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(HyMo model, its checkpoint, its export loaded by transformers.from_pretrained)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("exported")
    model = random_model(debug_args())
    step = make_checkpoint(root / "run", model)
    export(step, root / "hf")
    hf = AutoModelForCausalLM.from_pretrained(root / "hf", trust_remote_code=True)
    return model, step, root / "hf", hf.eval()


# -- the HF model computes HyMo's logits -----------------------------------------------------------

def test_from_pretrained_logits_equal_hymo(exported):
    model, _, _, hf = exported
    assert type(hf).__name__ == "HymoForCausalLM" and hf.dtype == torch.float32
    ids = torch.randint(0, 8192, (2, 70), generator=torch.Generator().manual_seed(1))  # crosses a 64-token chunk
    with torch.no_grad():
        logits, mtp = dropless(model)(ids)
        out = hf(ids, output_mtp_logits=True)
    torch.testing.assert_close(out.logits, logits, **TOL)
    assert len(out.mtp_logits) == 2
    for a, b in zip(out.mtp_logits, mtp):
        torch.testing.assert_close(a, b, **TOL)
    # every buffer came through: the selection bias changes which experts run
    bias = dict(hf.named_buffers())["model.layers.3.mlp.gate.e_score_correction_bias"]
    assert torch.equal(bias, model.layers["3"].moe.expert_bias) and bias.abs().sum() > 0


@pytest.mark.parametrize("variant", ["mup", "nope_and_gdn_ffn"])
def test_hf_logits_equal_hymo_variants(variant):
    """muP's logit multiplier and 1/d attention; a NoPE MLA layer and GDN blocks with a dense FFN."""
    if variant == "mup":
        args = debug_args(mup_base_width=128)  # width_mult 2: logits × 0.5
    else:
        args = debug_args(n_layers=5, mla_layers=(1, 4), nope_layers=(1,), gdn_ffn_dim=96)
    model = random_model(args, seed=2)
    hf = hf_model(model)
    if variant == "mup":
        assert hf.config.logit_multiplier == model.logit_multiplier == 0.5
        assert hf.config.attention_softmax_scale == 1 / 48
    ids = torch.randint(0, 8192, (2, 33), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, mtp = dropless(model)(ids)
        out = hf(ids, output_mtp_logits=True)
    torch.testing.assert_close(out.logits, logits, **TOL)
    for a, b in zip(out.mtp_logits, mtp):
        torch.testing.assert_close(a, b, **TOL)


def test_left_padding_and_the_cache_change_no_logit(exported):
    """A left-padded row computes what it computes alone, and token-by-token decoding with the
    cache computes what the full forward does."""
    model, _, _, hf = exported
    gen = torch.Generator().manual_seed(4)
    long, short = torch.randint(0, 8192, (1, 20), generator=gen), torch.randint(0, 8192, (1, 13), generator=gen)
    ids = torch.cat([long, torch.cat([torch.zeros(1, 7, dtype=torch.long), short], 1)])
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    with torch.no_grad():
        batch = hf(ids, attention_mask=mask).logits
        torch.testing.assert_close(batch[0], hf(long).logits[0], **TOL)
        torch.testing.assert_close(batch[1, 7:], hf(short).logits[0], **TOL)
        out = hf(ids[:, :10], attention_mask=mask[:, :10], use_cache=True)
        steps = [out.logits]
        for t in range(10, 20):
            out = hf(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=out.cache, use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1)[:, 7:], batch[:, 7:], **TOL)
    torch.testing.assert_close(torch.cat(steps, 1)[0], batch[0], **TOL)


def test_bf16_runs_close_to_fp32(exported):
    """The HF model in bf16 (GDN state and router in fp32): logits near fp32's, padded generation runs."""
    model, _, _, hf = exported
    low = copy.deepcopy(hf).to(torch.bfloat16)
    ids = torch.randint(0, 8192, (2, 40), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with torch.no_grad():
        ref = hf(ids).logits
        assert low(ids).logits.dtype == torch.bfloat16
        torch.testing.assert_close(low(ids).logits.float(), ref, rtol=0, atol=0.05 * float(ref.abs().max()))
        out = low.generate(ids[:, :12], attention_mask=mask[:, :12], max_new_tokens=3, do_sample=False, pad_token_id=1)
    assert out.shape == (2, 15)


def test_greedy_generate_matches_hymo(exported, capsys):
    """HF ``generate()`` (left-padded batch of two prompts) gives the tokens of HyMo's decoder and the
    text of ``python -m hymo_recipes.generate`` on the checkpoint."""
    from transformers import AutoTokenizer

    from hymo_recipes import generate

    model, step, folder, hf = exported
    tok = _tokenizer()
    prompts = ["The jury said", "It was a long time before the"]
    ids = [tok.encode(p, add_bos=True, add_eos=False) for p in prompts]
    n = 12
    ours = HymoDecoder(model).generate(ids, n, greedy=True, eos_id=None)

    hf_tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    assert hf_tok.convert_tokens_to_ids("<|eos|>") == tok.eos_id == hf.config.eos_token_id
    width = max(map(len, ids))
    batch = torch.tensor([[tok.eos_id] * (width - len(i)) + i for i in ids])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
    with torch.no_grad():
        out = hf.generate(batch, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          pad_token_id=tok.eos_id)
    theirs = out[:, width:].tolist()
    assert theirs == ours

    assert generate.main(["--checkpoint", str(step), "--tokenizer", str(TOKENIZER), "--greedy", "--ignore-eos",
                          "--max-new-tokens", str(n), "--device", "cpu", *sum((["--prompt", p] for p in prompts), [])]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text == ["--- 1/2", prompts[0] + hf_tok.decode(theirs[0]), "--- 2/2", prompts[1] + hf_tok.decode(theirs[1])]


def test_modeling_files_import_only_torch_and_transformers():
    for name in export_hf.MODELING_FILES:
        tree = ast.parse((REPO / "hymo_recipes" / "hf" / name).read_text())
        roots = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots.add(node.module.split(".")[0])
        assert roots <= {"__future__", "dataclasses", "torch", "transformers"}, (name, roots)


# -- export, import, round trip --------------------------------------------------------------------

def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_export_import_export_is_bitwise(exported, tmp_path):
    model, step, folder, _ = exported
    import_(folder, tmp_path / "run")
    back = tmp_path / "run" / "checkpoint" / "step-0"
    export(back, tmp_path / "again")
    assert _files(tmp_path / "again") == _files(folder)
    from hymo_recipes.generate import load_model

    reloaded = load_model(str(back), "debugmodel", debug_args(), torch.device("cpu"), torch.float32)
    for key, value in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], value), key
    config = json.loads((folder / "config.json").read_text())
    assert config["hymo"]["flavor"] == "debugmodel" and config["auto_map"]["AutoModelForCausalLM"]


def test_the_name_map_is_a_bijection():
    for args in (debug_args(), debug_args(n_layers=5, mla_layers=(1, 4), gdn_ffn_dim=96)):
        keys = list(HymoModel(args).state_dict())
        hf = [names.to_hf_name(k) for k in keys]
        assert len(set(hf)) == len(keys) and "lm_head.weight" not in hf
        assert [names.from_hf_name(k) for k in hf] == keys
    with pytest.raises(KeyError):
        names.to_hf_name("layers.0.attn.unknown.weight")


def test_the_train_spec_carries_the_adapter():
    """TorchTitan builds the adapter from the TrainSpec as ``state_dict_adapter(model_args, hf_assets_path)``."""
    from hymo_recipes.titan.spec import get_train_spec

    args = debug_args()
    adapter = get_train_spec().state_dict_adapter(args, str(TOKENIZER))
    assert adapter.fqn_to_index_mapping is None and adapter.hf_assets_path == str(TOKENIZER)
    state = random_model(args).state_dict()
    hf = adapter.to_hf(state)
    assert set(hf) == {names.to_hf_name(k) for k in state}
    back = adapter.from_hf(hf)
    assert list(back) == list(state) and all(back[k] is state[k] for k in state)


def test_export_carries_mup(tmp_path):
    """muP's base width goes from the manifest (or, without one, the training TOML's [hymo]) into
    config.json's logit multiplier."""
    model = random_model(debug_args(mup_base_width=64), seed=5)
    step = make_checkpoint(tmp_path / "run", model)
    export(step, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["logit_multiplier"] == 0.25 == model.logit_multiplier
    (step / "hymo_manifest.json").unlink()
    toml = tmp_path / "mup.toml"
    toml.write_text('[model]\nname = "hymo"\nflavor = "debugmodel"\n[hymo]\nmup_base_width = 64\n')
    export(step, tmp_path / "hf2", "--config", toml, "--tokenizer", TOKENIZER)
    assert (tmp_path / "hf2" / "model.safetensors").read_bytes() == (tmp_path / "hf" / "model.safetensors").read_bytes()
    assert json.loads((tmp_path / "hf2" / "config.json").read_text())["logit_multiplier"] == 0.25


# -- a training run from an import, saving its last step in HF format ------------------------------

@pytest.fixture(scope="module")
def run_from_import(exported, tmp_path_factory):
    """A 2-process CPU run that starts from an imported export and saves step 1 as DCP and its last
    step (2) in HF safetensors through TorchTitan's --checkpoint.last_save_in_hf."""
    _, _, folder, _ = exported
    root = tmp_path_factory.mktemp("from_import")
    import_(folder, root / "run")
    env = dict(os.environ, NGPU="2", CONFIG_FILE=CONFIG)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.run(
        ["./run_train.sh", "--job.dump_folder", str(root / "run"), "--training.steps", "2", "--checkpoint.interval", "1",
         "--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only", "--validation.no-enable",
         "--metrics.no-enable-tensorboard", "--training.seq_len", "64", "--training.local_batch_size", "2"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    return root / "run", proc.returncode, proc.stdout + proc.stderr


@pytest.mark.slow
def test_an_import_resumes_training(exported, run_from_import):
    model, _, _, _ = exported
    run, _, log = run_from_import
    step0, step1 = run / "checkpoint" / "step-0", run / "checkpoint" / "step-1"
    assert f"Loading the checkpoint from {step0}" in log, log[-4000:]
    assert (step1 / ".metadata").is_file() and (step1 / "__1_0.distcp").is_file(), log[-4000:]  # two ranks wrote it
    from hymo_recipes.generate import load_model

    trained = load_model(str(step1), "debugmodel", debug_args(), torch.device("cpu"), torch.float32).state_dict()
    fresh = random_model(debug_args(), seed=7).state_dict()
    # one optimizer step away from the import (AdamW moves each entry by about its lr, 2e-3: up to a
    # third of the smallest-init matrices), far from a fresh init (about √2 of its norm away)
    for key, value in model.named_parameters():
        if value.dim() >= 2:
            value = value.detach()
            moved, other = (trained[key] - value).norm() / value.norm(), (fresh[key] - value).norm() / value.norm()
            assert moved < 0.5 < other, (key, float(moved), float(other))


@pytest.mark.slow
def test_a_two_process_checkpoint_round_trips_bitwise(run_from_import, tmp_path):
    run, _, log = run_from_import
    step1 = run / "checkpoint" / "step-1"
    assert (step1 / ".metadata").is_file(), log[-4000:]
    export(step1, tmp_path / "hf")
    import_(tmp_path / "hf", tmp_path / "back")
    export(tmp_path / "back" / "checkpoint" / "step-0", tmp_path / "again")
    assert _files(tmp_path / "again") == _files(tmp_path / "hf")


@pytest.mark.slow
def test_last_save_in_hf_writes_the_adapters_names(run_from_import, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run, rc, log = run_from_import
    assert rc == 0, log[-6000:]
    step2 = run / "checkpoint" / "step-2"
    index = json.loads((step2 / "model.safetensors.index.json").read_text())
    want = {names.to_hf_name(k): tuple(v.shape) for k, v in HymoModel(debug_args()).state_dict().items()}
    tensors = {}
    for f in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(step2 / f))
    assert {k: tuple(v.shape) for k, v in tensors.items()} == want
    export(step2, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    model = random_model(debug_args())
    model.load_state_dict(names.from_hf(tensors))
    ids = torch.randint(0, 8192, (1, 40), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, dropless(model)(ids)[0], **TOL)


# -- bad input -------------------------------------------------------------------------------------

def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def _copy_export(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.parametrize("case", ["missing", "not_an_export", "dcp_not_export", "model_type", "contradiction",
                                  "shape", "no_tokenizer", "out_has_checkpoints"])
def test_import_bad_input_fails_in_one_line(exported, tmp_path, capsys, case):
    from safetensors.torch import load_file, save_file

    _, step, folder, _ = exported
    src, out = tmp_path / "hf", tmp_path / "run"
    if case == "missing":
        src, expect = tmp_path / "nothing", "the path does not exist"
    elif case == "not_an_export":
        src.mkdir()
        expect = "it has no config.json"
    elif case == "dcp_not_export":
        src, expect = step, "it is a DCP checkpoint (python -m hymo_recipes.export_hf exports it)"
    else:
        _copy_export(folder, src)
        if case == "model_type":
            _edit_config(src, model_type="llama")
            expect = "wrong config.json in"
        elif case == "contradiction":
            _edit_config(src, hidden_size=512)
            expect = "hidden_size is 512, its hymo.model_args give 256"
        elif case == "shape":
            tensors = load_file(src / "model.safetensors")
            tensors["model.norm.weight"] = torch.ones(255)
            save_file(tensors, src / "model.safetensors")
            expect = "shape mismatch: model.norm.weight is [255]"
        elif case == "no_tokenizer":
            (src / "tokenizer.json").unlink()
            expect = "no tokenizer.json in"
        else:
            (out / "checkpoint" / "step-5").mkdir(parents=True)
            expect = "already holds checkpoints (step-5)"
    assert import_hf.main([str(src), str(out)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert captured.out == "" and len(err) == 1 and err[0].startswith("import_hf: error: ") and expect in err[0], err


@pytest.mark.parametrize("case", ["missing", "not_a_checkpoint", "flavor", "out_not_empty", "overwrite_not_export",
                                  "hf_export"])
def test_export_bad_input_fails_in_one_line(exported, tmp_path, capsys, case):
    _, step, folder, _ = exported
    src, out, extra = step, tmp_path / "out", []
    if case == "missing":
        src, expect = tmp_path / "nothing", "the path does not exist"
    elif case == "not_a_checkpoint":
        src = tmp_path / "empty"
        src.mkdir()
        expect = "no checkpoint at"
    elif case == "flavor":
        extra, expect = ["--flavor", "small"], "was trained with flavor 'debugmodel', not 'small'"
    elif case == "out_not_empty":
        out.mkdir()
        (out / "x").write_text("x")
        expect = "is not empty (pass --overwrite"
    elif case == "overwrite_not_export":
        out.mkdir()
        (out / "x").write_text("x")
        extra, expect = ["--overwrite"], "is not empty and not a HyMo export"
    else:
        src, expect = folder, "is already a Hugging Face export"
    assert export_hf.main([str(src), str(out), *extra]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert captured.out == "" and len(err) == 1 and err[0].startswith("export_hf: error: ") and expect in err[0], err


# -- lm-eval on an export ---------------------------------------------------------------------------

@pytest.mark.slow
def test_lm_eval_runs_the_local_brown_tasks(exported, tmp_path):
    """``lm_eval --model hf ... --tasks brown --include_path evals/brown`` offline on 3 documents and 3
    cloze examples; the cloze's perplexity and accuracy are what HyMo's forward gives."""
    import math

    sys.path.insert(0, str(REPO / "evals" / "brown"))
    try:
        import brown
    finally:
        sys.path.pop(0)
    model, _, folder, _ = exported
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.run(
        ["lm_eval", "--model", "hf", "--model_args", f"pretrained={folder},trust_remote_code=True,max_length=128",
         "--tasks", "brown", "--include_path", str(REPO / "evals" / "brown"), "--limit", "3", "--batch_size", "1",
         "--device", "cpu", "--output_path", str(tmp_path / "results")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    results = {}
    for f in (tmp_path / "results").rglob("results_*.json"):
        results.update(json.loads(f.read_text())["results"])
    ppl, cloze = results["brown_ppl"], results["brown_cloze"]
    assert 1 < ppl["word_perplexity,none"] < math.inf and 0 < ppl["bits_per_byte,none"] < 20

    tok = _tokenizer()
    lls, greedy = [], []
    for ex in brown.cloze()["validation"].select(range(3)):  # lm-eval's encoding: no BOS before a context
        context = tok.encode(ex["context"], add_bos=False, add_eos=False)
        whole = tok.encode(ex["context"] + " " + ex["target"], add_bos=False, add_eos=False)
        ids = torch.tensor([whole[-129:][:-1]])
        n = len(whole) - len(context)
        with torch.no_grad():
            logp = torch.log_softmax(dropless(model)(ids)[0][0, -n:].double(), -1)
        target = torch.tensor(whole[-n:])
        lls.append(float(logp.gather(-1, target[:, None]).sum()))
        greedy.append(bool((logp.argmax(-1) == target).all()))
    assert cloze["perplexity,none"] == pytest.approx(math.exp(-sum(lls) / len(lls)), rel=1e-4)
    assert cloze["acc,none"] == pytest.approx(sum(greedy) / len(greedy))
