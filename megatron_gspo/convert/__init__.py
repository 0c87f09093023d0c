"""Hugging Face Qwen3 / Qwen3-MoE <-> Megatron-Core checkpoints: the name/layout map and streaming I/O.

- `hf_config`: config.json -> `Qwen3Shape` (refusing what the model cannot represent).
- `mapping`: the one declarative HF <-> Megatron table, its inverse, and the fused layouts.
- `hf_to_mcore` / `mcore_to_hf`: streaming converters between safetensors and torch_dist.
- `safetensors_io` / `dcp_io`: the two formats, one tensor at a time (`mapped`: file bytes as tensors, no copy).
- `export`: HF-named full tensors from a live, sharded Megatron model (for weight sync).
- `load`: a converted checkpoint's weights into this rank's model chunks, any layout.
- `parity`: per-token log-probs of transformers vs the Megatron model (tools/check_hf_mcore_parity.py).
"""
from megatron_gspo.convert.export import iter_hf_tensors
from megatron_gspo.convert.hf_config import read_hf_config
from megatron_gspo.convert.hf_to_mcore import convert_hf_to_mcore
from megatron_gspo.convert.load import load_weights
from megatron_gspo.convert.mcore_to_hf import convert_mcore_to_hf

__all__ = ["convert_hf_to_mcore", "convert_mcore_to_hf", "iter_hf_tensors", "load_weights", "read_hf_config"]
