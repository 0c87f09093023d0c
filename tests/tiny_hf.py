"""Tiny Hugging Face Qwen3-MoE / Qwen3 checkpoints made by transformers itself (test scaffolding).

The sizes are `TinyQwen3Spec`s (megatron_gspo/dev/tiny_model.py, the project's one tiny-Qwen3
definition); the weights are drawn here.

The files are what `save_pretrained` writes, not what we think it writes. Weights are random with a
fixed seed, wider than transformers' default init and with non-unit norm weights, so that a wrong
mapping (a swapped norm, a mis-ordered head) changes the log-probs visibly.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from megatron_gspo.dev.tiny_model import TinyQwen3Spec, tiny_qwen3_config

# GQA (4 heads, 2 KV heads), head_dim 24 != hidden / heads = 16, 4 experts top-2, vocab 300
# (padded by Megatron to 384 at TP1 and 512 at TP2). initializer_range: transformers' default (the
# weights are drawn by save_tiny, not by the init).
COMMON = dict(vocab_size=300, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
              max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=1_000_000.0, initializer_range=0.02)
MOE = dict(intermediate_size=96, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)
KINDS = {
    "moe": TinyQwen3Spec(**COMMON, **MOE, num_layers=4, norm_topk_prob=True),
    "moe_no_norm_topk": TinyQwen3Spec(**COMMON, **MOE, num_layers=2, norm_topk_prob=False),
    "dense_tied": TinyQwen3Spec(**COMMON, num_layers=2, intermediate_size=128, tie_word_embeddings=True),
}


def make_config(kind: str):
    return tiny_qwen3_config(KINDS[kind])


def save_tiny(directory: Path, kind: str, dtype: torch.dtype = torch.float32, *,
              max_shard_size: str | None = None, seed: int = 0) -> Path:
    """Save a random tiny model of `kind` with save_pretrained; returns `directory`."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(kind))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.1)
    model.to(dtype).save_pretrained(directory, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return directory


def hf_logprobs(directory: Path, tokens_BS: torch.Tensor) -> torch.Tensor:
    """transformers' float32 log-probs of tokens[:, 1:] given tokens[:, :-1]: [B, S-1]."""
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(tokens_BS).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens_BS[:, 1:, None]).squeeze(-1)


def read_all(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint directory, via the safetensors library."""
    out = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                out[name] = f.get_tensor(name)
    return out


def fake_hf_dir(directory: Path) -> Path:
    """A model directory that passes preflight without weights: the demo's tiny Qwen3 config.json (preflight
    checks the parallel layout against its shape) and the tiny tokenizer (with its chat template), for tests
    of checks made before any model loads."""
    from megatron_gspo.dev.tiny_model import make_tiny_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    tiny_qwen3_config(TinyQwen3Spec(), architectures=["Qwen3ForCausalLM"]).to_json_file(directory / "config.json")
    make_tiny_tokenizer().save_pretrained(directory)
    return directory


def hf_routing(model, token_ids: list[int], tie: float = 1e-4) -> tuple:
    """The experts a transformers Qwen3-MoE's routers pick for each position and layer ([T, L, k] numpy,
    sorted per row), and where the k-th and (k+1)-th router logits are within `tie` ([T, L]: either pick is
    right), from one forward of `token_ids`."""
    import numpy as np

    outputs = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda module, args, out: outputs.append(out))
             for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(torch.tensor([token_ids]))
    finally:
        for hook in hooks:
            hook.remove()
    k = model.config.num_experts_per_tok
    picks = torch.stack([indices for _, _, indices in outputs], dim=1)
    top = torch.stack([logits for logits, _, _ in outputs], dim=1).topk(k + 1, dim=-1).values
    return np.sort(picks.numpy(), axis=-1), (top[..., k - 1] - top[..., k] < tie).numpy()
