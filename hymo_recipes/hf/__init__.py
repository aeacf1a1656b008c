"""Hugging Face format for HyMo: the name map, TorchTitan's state-dict adapter, the HF model.

- names.py: HyMo's parameter names <-> HF names (pure Python);
- (hymo_recipes/titan/state_dict_adapter.py: the TrainSpec's ``state_dict_adapter`` over names.py);
- configuration_hymo.py, modeling_hymo.py: the HF config and model (torch and transformers only,
  no HyMo import), copied into every export and loaded with ``trust_remote_code=True``.

``python -m hymo_recipes.export_hf`` and ``python -m hymo_recipes.import_hf`` write and read
exports; evals/brown holds lm-eval tasks to run on one. Importing this package imports nothing.
"""
