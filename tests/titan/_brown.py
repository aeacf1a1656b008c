"""The embedded Brown corpus for the dataloader tests: its tokenizer and a HyMo dataloader over it."""

from pathlib import Path
from types import SimpleNamespace

import pytest

import hymo_recipes.titan  # noqa: F401  (registers the TrainSpec and the datasets; CPU shims first)
from hymo_recipes.titan.api import JobConfig
from hymo_recipes.titan.datasets import build_tokenizer
from hymo_recipes.titan.dataloader import build_hymo_dataloader

REPO = Path(__file__).resolve().parents[2]


def brown_tokenizer():
    if not (REPO / "assets/tokenizer/tokenizer.json").exists():
        pytest.fail("run `python -m hymo_recipes.data.prepare` first")
    return build_tokenizer(SimpleNamespace(model=SimpleNamespace(hf_assets_path=str(REPO / "assets/tokenizer"))))


def brown_loader(tokenizer, rank: int, world: int, seq: int, batch: int, workers: int = 0):
    config = JobConfig()  # TorchTitan's defaults: [training.dataloader] num_workers = 0, ...
    config.training.dataloader.num_workers = workers
    config.training.dataset = "brown"
    config.training.dataset_path = str(REPO / "data/brown")
    config.training.seq_len, config.training.local_batch_size = seq, batch
    return build_hymo_dataloader(world, rank, tokenizer, config)
