"""Data preparation pieces, local dataset loading and the tokenizer checks."""

import json
from types import SimpleNamespace

import pytest

import hymo_recipes.titan  # noqa: F401  (registers the TrainSpec and the datasets; CPU shim 1 first)
from hymo_recipes.data import load_local
from hymo_recipes.titan.datasets import build_tokenizer
from hymo_recipes.data.prepare import (
    BOS_TOKEN,
    EOS_TOKEN,
    PREPARE_COMMAND,
    brown_to_text,
    split_documents,
    train_tokenizer,
)

BROWN_SAMPLE = (
    "\n\n\tThe/at jury/nn said/vbd ,/, ``/`` no/at evidence/nn ''/'' (/( of/in 1/2/cd )/) ./.\n"
    "It/pps is/bez ./.\n\n\n\tNot/* here/rb ?/.\n"
)


def test_brown_to_text_strips_tags_and_rejoins_punctuation():
    assert brown_to_text(BROWN_SAMPLE) == (
        'The jury said, "no evidence" (of 1/2). It is.\n\nNot here?'
    )


def test_split_holds_out_every_twentieth_document():
    docs = [(f"d{i:03d}", str(i)) for i in range(500)]
    train, validation = split_documents(docs)
    assert len(train) == 475 and len(validation) == 25
    assert validation[0][0] == "d019" and validation[-1][0] == "d499"
    assert not {d[0] for d in train} & {d[0] for d in validation}


def _tokenizer_dir(tmp_path, with_config=True):
    texts = ["The jury said no evidence.", "It is not here?"] * 20
    tokenizer = train_tokenizer(texts, vocab_size=300)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    if with_config:
        (tmp_path / "tokenizer_config.json").write_text(
            json.dumps({"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN}))
    return tmp_path


def _job(path):
    return SimpleNamespace(model=SimpleNamespace(hf_assets_path=str(path)))


def test_trained_tokenizer_round_trips_and_frames_documents(tmp_path):
    tokenizer = build_tokenizer(_job(_tokenizer_dir(tmp_path)))
    assert (tokenizer.bos_id, tokenizer.eos_id) == (0, 1)
    ids = tokenizer.encode("Any text, even ünïcode!", add_bos=True, add_eos=True)
    assert ids[0] == 0 and ids[-1] == 1
    assert tokenizer.decode(ids[1:-1]) == "Any text, even ünïcode!"


def test_missing_default_tokenizer_says_how_to_prepare(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=PREPARE_COMMAND):
        build_tokenizer(_job("./assets/tokenizer"))


def test_tokenizer_without_eos_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no EOS token"):
        build_tokenizer(_job(_tokenizer_dir(tmp_path, with_config=False)))


def test_missing_default_dataset_says_how_to_prepare(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=PREPARE_COMMAND):
        load_local("data/brown", split="train")


def test_local_dataset_forms(tmp_path):
    (tmp_path / "one.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n')
    assert load_local(str(tmp_path / "one.jsonl"), split="train")["text"] == ["a", "b"]

    split_dir = tmp_path / "splits"
    split_dir.mkdir()
    (split_dir / "train.jsonl").write_text('{"text": "t"}\n')
    (split_dir / "validation.jsonl").write_text('{"text": "v"}\n')
    assert load_local(str(split_dir), split="validation")["text"] == ["v"]

    txt_dir = tmp_path / "txt"
    txt_dir.mkdir()
    (txt_dir / "a.txt").write_text("first line\nsecond line\n")
    (txt_dir / "b.txt").write_text("other")
    texts = load_local(str(txt_dir), split="train")["text"]
    assert len(texts) == 2 and texts[0].startswith("first line\nsecond line")


def test_local_dataset_errors(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"body": "a"}\n')
    with pytest.raises(ValueError, match="no 'text' column"):
        load_local(str(tmp_path / "x.jsonl"), split="train")
    (tmp_path / "x.csv").write_text("text\na\n")
    with pytest.raises(ValueError, match="expected"):
        load_local(str(tmp_path / "x.csv"), split="train")
    with pytest.raises(ValueError, match="needs dataset_path"):
        load_local("", split="train")
    with pytest.raises(FileNotFoundError, match="check dataset_path"):
        load_local(str(tmp_path / "nope"), split="train")
