"""Named model shapes: tiny ones for CPU tests and demos, and the Qwen3-MoE models of the GSPO paper.

The real models' numbers are their Hugging Face `config.json` values (Qwen/Qwen3-30B-A3B,
Qwen/Qwen3-235B-A22B); a run from an HF directory reads the shape from there instead.
"""
from __future__ import annotations

from megatron_gspo.model.gpt import TINY_MOE, Qwen3Shape

# A dense Qwen3 small enough to train in seconds on two CPU cores (qk-norm, GQA, SwiGLU, RoPE).
TINY_DENSE = Qwen3Shape(vocab_size=500, hidden_size=64, num_layers=2, num_attention_heads=4,
                        num_query_groups=2, head_dim=16, ffn_hidden_size=128, rotary_base=10000.0,
                        max_position_embeddings=512)

QWEN3_30B_A3B = Qwen3Shape(vocab_size=151936, hidden_size=2048, num_layers=48, num_attention_heads=32,
                           num_query_groups=4, head_dim=128, ffn_hidden_size=6144, num_experts=128,
                           moe_ffn_hidden_size=768, moe_router_topk=8, max_position_embeddings=40960)

QWEN3_235B_A22B = Qwen3Shape(vocab_size=151936, hidden_size=4096, num_layers=94, num_attention_heads=64,
                             num_query_groups=4, head_dim=128, ffn_hidden_size=12288, num_experts=128,
                             moe_ffn_hidden_size=1536, moe_router_topk=8, max_position_embeddings=40960)

PRESETS: dict[str, Qwen3Shape] = {
    "tiny_dense": TINY_DENSE,
    "tiny_moe": TINY_MOE,
    "qwen3_30b_a3b": QWEN3_30B_A3B,
    "qwen3_235b_a22b": QWEN3_235B_A22B,
}
