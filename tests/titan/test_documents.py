"""Document masking through the training path's pieces: batches from HyMo's dataloader (the real
tokenizer and packing), their boundaries from hymo_recipes.titan.documents, the model called
as TorchTitan's train step calls it (``model(inputs, **extra_inputs)``): every document's logits
and every parameter's gradient are those of the document run alone (fp32)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import hymo_recipes.titan  # noqa: F401  (registers the TrainSpec and the datasets; CPU shim 1 first)
from _brown import brown_loader, brown_tokenizer
from hymo_recipes.model import HymoModel, hymo_flavors
from hymo_recipes.titan import documents

SEQ, BATCH = 128, 3
ON = SimpleNamespace(hymo=SimpleNamespace(document_masking=True))


@pytest.fixture(scope="module")
def tokenizer():
    return brown_tokenizer()


def batch_with_a_document_start(tokenizer):
    """The first training batch (B = 3 rows of 128) with a BOS inside a row, not at its start."""
    for input_dict, _ in brown_loader(tokenizer, 0, 1, SEQ, BATCH):
        if bool((input_dict["input"][:, 1:] == tokenizer.bos_id).any()):
            return input_dict
    pytest.fail("no batch of the Brown training split has a document start inside a row")


def test_each_document_of_a_training_batch_is_computed_alone(tokenizer):
    torch.manual_seed(0)
    args = dataclasses.replace(hymo_flavors["debugmodel"], vocab_size=tokenizer.get_vocab_size(),
                               moe_capacity_factor=0.0)  # dropless: capacity couples the documents
    model = HymoModel(args)
    model.init_weights()
    input_dict = batch_with_a_document_start(tokenizer)
    extra = documents.splitter(ON, tokenizer)(input_dict["input"])
    cu = extra["cu_seqlens"]
    tokens = input_dict["input"]
    assert cu.numel() - 1 > BATCH  # more documents than rows
    assert set(range(0, BATCH * SEQ, SEQ)) <= set(cu.tolist())  # every row starts one

    w = torch.randn(BATCH * SEQ, args.vocab_size)
    logits, mtp = model(tokens, **extra)
    (logits.reshape(BATCH * SEQ, -1) * w).sum().backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    flat = tokens.reshape(-1)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone, _ = model(flat[s:e][None])
        torch.testing.assert_close(logits.reshape(BATCH * SEQ, -1)[s:e], alone[0].detach(), rtol=1e-5, atol=1e-5)
        (alone[0] * w[s:e]).sum().backward()
    for n, p in model.named_parameters():
        if n in packed:
            torch.testing.assert_close(packed[n], p.grad, rtol=1e-4, atol=1e-4 * float(p.grad.abs().max()), msg=n)
    with torch.no_grad():  # off: the rows as they are, a document seeing the one before it
        plain, _ = model(tokens)
    assert not torch.allclose(plain, logits.detach(), atol=1e-4)


def test_boundaries_from_eos_when_the_tokenizer_has_no_bos(tokenizer):
    tokens = batch_with_a_document_start(tokenizer)["input"]
    from_bos = documents.splitter(ON, tokenizer)(tokens)
    no_bos = SimpleNamespace(bos_id=None, eos_id=tokenizer.eos_id)
    from_eos = documents.splitter(ON, no_bos)(tokens)
    # the packing puts EOS right before each BOS, so both find the same starts
    assert torch.equal(from_bos["cu_seqlens"], from_eos["cu_seqlens"])
    assert torch.equal(from_bos["positions"], from_eos["positions"])


@pytest.mark.parametrize("training", [True, False])
def test_validation_follows_training_unless_told(tokenizer, training):
    def config(mode):
        return SimpleNamespace(hymo=SimpleNamespace(document_masking=training, validation_document_masking=mode))

    assert (documents.splitter(config("auto"), tokenizer) is None) == (not training)
    assert (documents.splitter(config("auto"), tokenizer, validation=True) is None) == (not training)
    assert documents.splitter(config("on"), tokenizer, validation=True) is not None
    assert documents.splitter(config("off"), tokenizer, validation=True) is None
    assert (documents.splitter(config("off"), tokenizer) is None) == (not training)  # training unaffected
    with pytest.raises(ValueError, match="validation_document_masking = 'yes': one of auto, on, off"):
        documents.splitter(config("yes"), tokenizer, validation=True)


def test_splitter_off_and_a_tokenizer_without_bos_or_eos(tokenizer):
    assert documents.splitter(SimpleNamespace(hymo=SimpleNamespace(document_masking=False)), tokenizer) is None
    with pytest.raises(ValueError, match="neither: pass --hymo.no-document_masking"):
        documents.splitter(ON, SimpleNamespace(bos_id=None, eos_id=None))
