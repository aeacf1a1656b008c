"""HyMo recipes: hybrid Gated DeltaNet / MLA-MoE language models trained with TorchTitan.

- ``hymo_recipes.model``: the model (pure PyTorch); ``hymo_recipes.optim``: NorMuon,
  CautiousAdamW, the parameter table, the NaN guard; ``hymo_recipes.scheduler``: the WSD
  schedule; ``hymo_recipes.data``: the text sources and ``prepare``.
- ``hymo_recipes.titan``: the TorchTitan seam (TrainSpec, entry point, containers, metrics,
  config). Nothing outside it imports TorchTitan, so importing this package imports none.
- ``python -m hymo_recipes.train``: the training entry point (run_train.sh runs it).
"""
