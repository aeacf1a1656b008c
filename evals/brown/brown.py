"""lm-eval tasks on the Brown Corpus validation documents (``data/brown/validation.parquet``).

The documents are the 25 the training config holds out (``python -m hymo_recipes.data.prepare``
writes them), so both tasks read text the model never trained on, and need no network:

- ``brown_ppl``: each whole document scored token by token (``loglikelihood_rolling``: windows of
  the model's max length, every token predicted once, the first after the tokenizer's BOS);
  word and byte perplexity and bits per byte, as lm-eval's wikitext task reports them.
- ``brown_cloze``: next-word cloze in LAMBADA's form: every paragraph of 30 words or more that
  ends in a word (letters, then closing punctuation) gives one example, the paragraph's last
  MAX_CONTEXT_WORDS words before that word as context and `` word`` as the target; accuracy (the greedy continuation is the word)
  and the target's perplexity.

``--metadata '{"data_dir": "<folder with validation.parquet>"}'`` reads another copy.
"""

from __future__ import annotations

import os
import re

DEFAULT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "data", "brown")
MIN_WORDS = 30
MAX_CONTEXT_WORDS = 100  # about 150 tokens: within the debug model's training length
_LAST_WORD = re.compile(r"^(?P<context>.*\S)\s+(?P<word>[A-Za-z]+)(?P<tail>[.!?;:,'\"`)]*)$", re.S)


def _documents(data_dir: str | None) -> list[dict]:
    import pyarrow.parquet as pq

    path = os.path.join(data_dir or DEFAULT_DIR, "validation.parquet")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{os.path.normpath(path)} is missing: run `python -m hymo_recipes.data.prepare` in "
                                "the repository (or pass --metadata '{\"data_dir\": DIR}')")
    return pq.read_table(path, columns=["id", "text"]).to_pylist()


def _dataset(rows: list[dict]):
    import datasets

    return datasets.DatasetDict({"validation": datasets.Dataset.from_list(rows)})


def documents(data_dir: str | None = None, **kwargs):
    """brown_ppl's dataset: one row per validation document (id, text)."""
    return _dataset(_documents(data_dir))


def cloze_examples(text: str) -> list[tuple[str, str]]:
    """(context, word) for every paragraph of `text` with at least MIN_WORDS words that ends in a word."""
    out = []
    for paragraph in text.split("\n\n"):
        paragraph = " ".join(paragraph.split())
        if len(paragraph.split()) < MIN_WORDS:
            continue
        m = _LAST_WORD.match(paragraph)
        if m:
            out.append((" ".join(m.group("context").split()[-MAX_CONTEXT_WORDS:]), m.group("word")))
    return out


def cloze(data_dir: str | None = None, **kwargs):
    """brown_cloze's dataset: one row per example (id, context, target)."""
    rows = [{"id": f"{doc['id']}-{i}", "context": context, "target": word}
            for doc in _documents(data_dir) for i, (context, word) in enumerate(cloze_examples(doc["text"]))]
    return _dataset(rows)


def process_ppl(doc, results):
    (loglikelihood,) = results
    words = len(re.split(r"\s+", doc["text"]))
    nbytes = len(doc["text"].encode("utf-8"))
    return {"word_perplexity": (loglikelihood, words), "byte_perplexity": (loglikelihood, nbytes),
            "bits_per_byte": (loglikelihood, nbytes)}
