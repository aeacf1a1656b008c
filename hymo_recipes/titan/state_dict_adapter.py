"""HyMo's TorchTitan state-dict adapter: the TrainSpec's ``state_dict_adapter``.

TorchTitan's checkpointer converts through it when it saves the last step in HF safetensors
(``--checkpoint.last_save_in_hf``, with ``--checkpoint.last_save_model_only``) and when it
loads HF weights (``--checkpoint.initial_load_in_hf``). The renaming is names.py's table;
tensors (DTensor shards under FSDP2 included) pass through untouched, so DCP's HF writer saves
each rank's shards and consolidates them into whole tensors. The step folder such a save
writes holds the weights only: ``python -m hymo_recipes.export_hf`` on it adds config.json, the
modeling code and the tokenizer.
"""

from __future__ import annotations

import os
from typing import Any

from hymo_recipes.hf import names

from .api import StateDictAdapter


class HymoStateDictAdapter(StateDictAdapter):
    """HyMo names <-> HF names (hymo_recipes/hf/names.py), for TorchTitan's checkpointer.

    Args:
        model_args: the run's HymoModelArgs (the mapping does not depend on them: every name
            carries its layer's index and block type).
        hf_assets_path: ``model.hf_assets_path``; its ``model.safetensors.index.json``, if it
            has one, decides how a save is split into files (TorchTitan's rule), else one file.
    """

    def __init__(self, model_args, hf_assets_path: str | None):
        if hf_assets_path and os.path.isfile(os.path.join(hf_assets_path, "model.safetensors.index.json")):
            super().__init__(model_args, hf_assets_path)
        else:
            # HyMo's hf_assets_path is a tokenizer folder: the base class would warn at every start
            # that it has no safetensors index, which is what HyMo expects
            self.hf_assets_path = hf_assets_path
            self.fqn_to_index_mapping = None
        self.model_args = model_args

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return names.to_hf(state_dict)

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        return names.from_hf(hf_state_dict)
