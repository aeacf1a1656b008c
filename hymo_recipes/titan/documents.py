"""Document masking (``[hymo] document_masking``): each batch's document boundaries, from its tokens.

The packing (hymo_recipes/titan/dataloader.py) puts each document between BOS and EOS and cuts
the stream into rows; a document starts at every BOS token (for a tokenizer without one: after
every EOS) and at every row start (rows are independent samples). ``splitter`` returns the
function the train step and the validator call on each batch's input tokens: it adds
``cu_seqlens`` and ``positions`` to the model's inputs (TorchTitan passes every key of the input
dict but "input" to the model's forward), computed where the tokens are, so that on the GPU
path they are made on the host before the copy and the model never reads them back.
"""

from __future__ import annotations

from typing import Callable

import torch

from hymo_recipes.model.model import documents_of


VALIDATION_MODES = ("auto", "on", "off")  # [hymo] validation_document_masking


def masked(job_config, validation: bool = False) -> bool:
    """Whether training (or, with ``validation``, the held-out loss) splits rows into documents."""
    hymo = getattr(job_config, "hymo", None)
    if hymo is None:
        return False
    if validation:
        mode = getattr(hymo, "validation_document_masking", "auto")
        if mode not in VALIDATION_MODES:
            raise ValueError(f"[hymo] validation_document_masking = {mode!r}: one of {', '.join(VALIDATION_MODES)}")
        if mode != "auto":
            return mode == "on"
    return bool(hymo.document_masking)


def splitter(job_config, tokenizer, validation: bool = False) -> Callable[[torch.Tensor], dict[str, torch.Tensor]] | None:
    """None when document masking is off (for training, or with ``validation`` for the held-out
    loss); else tokens [B, T] -> {"cu_seqlens", "positions"}."""
    if not masked(job_config, validation):
        return None
    bos, eos = getattr(tokenizer, "bos_id", None), getattr(tokenizer, "eos_id", None)
    if bos is None and eos is None:
        raise ValueError("[hymo] document_masking needs a tokenizer with a BOS or EOS token to find the "
                         "documents' starts; this one has neither: pass --hymo.no-document_masking (or set "
                         "[hymo] document_masking = false; and validation_document_masking = \"off\" "
                         "if it is \"on\")")

    def split(tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        cu, positions = documents_of(tokens, start_id=bos) if bos is not None else documents_of(tokens, end_id=eos)
        return {"cu_seqlens": cu, "positions": positions}

    return split
