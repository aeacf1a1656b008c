"""HyMo recipes: a TorchTitan recipe for hybrid Gated DeltaNet / MLA-MoE language models."""
