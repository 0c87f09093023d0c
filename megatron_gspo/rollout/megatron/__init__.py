"""The in-process rollout backend: the trained Megatron model samples on every rank (backend.py), with a
KV-cache-free decode loop (generator.py) and counter-based sampling from sharded logits (sampling.py)."""
