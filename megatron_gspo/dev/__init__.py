"""Dev and demo tooling, not used by training or rollout: the tiny local Qwen3 and its warm-start.

`tiny_model`: a tiny Qwen3 / Qwen3-MoE and its tokenizer, made locally (`megatron-gspo tiny-model`, the
tests' and benchmarks' models). `warm_start`: the supervised format warm-start of the arithmetic demo.
"""
