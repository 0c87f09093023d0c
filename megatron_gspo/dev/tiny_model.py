"""A tiny Qwen3 (dense or MoE) and its tokenizer, made locally (no model hub) for CPU rollout tests and demos.

The model is randomly initialised from a fixed seed; the tokenizer is a byte-level BPE trained on a
synthetic arithmetic corpus ("12+7=19"). Both are written as a Hugging Face model directory that
SGLang (`--model-path DIR`) and transformers (`AutoModelForCausalLM`, `AutoTokenizer`) load.
Dense by default; `num_experts > 0` makes a Qwen3-MoE instead, which SGLang 0.5.23 also serves on CPU (in
float32 its log-probs and routed experts equal transformers': tests/sglang/test_sglang_moe_cpu.py), as does the
in-process Megatron rollout backend.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

EOS_TOKEN = "<|endoftext|>"

CHAT_TEMPLATE = (
    "{%- if tools -%}tools:"
    "{%- for t in tools -%}{{ t.function.name }}({{ t.function.parameters.properties | list | join(',') }})"
    "{%- if not loop.last %},{% endif -%}{%- endfor -%}{{ '\\n' }}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}{{ m.content }}{{ '\\n' }}"
    "{%- elif m.role == 'user' -%}{{ m.content }}="
    "{%- elif m.role == 'tool' -%}<tool_response>{{ m.content }}</tool_response>{{ '\\n' }}"
    "{%- else -%}{{ m.content }}{{ eos_token }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)
"""The tiny tokenizer's chat template: the demo's plain text in chat form. A user message "3+4" renders as
"3+4=" (the prompt the model always saw), an assistant message as its content + EOS ("7<|endoftext|>"),
a system message as its content + a newline before them. `add_generation_prompt` adds nothing: the
"=" that asks for the answer already ends each user turn. With tools (`apply_chat_template(..., tools=...)`)
a first line names each with its parameters ("tools:calculator(expression)\\n"), and a `tool` message renders
as "<tool_response>CONTENT</tool_response>\\n" (the model's calls are its own text, in Qwen3's format:
rollout/agent/tools.py)."""

TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
"""Added tokens of a `tools=True` tokenizer (ordinary ones, as in Qwen3: decoding keeps them)."""


@dataclass(frozen=True)
class TinyQwen3Spec:
    """Size and seed of the tiny model: the one definition of a tiny Qwen3 / Qwen3-MoE in this project.

    The defaults are the demo's model (`megatron-gspo tiny-model`); tests that need other sizes pass
    them as fields (tests/tiny_hf.py).
    """

    vocab_size: int = 512
    """Tokenizer and embedding size: 256 byte symbols + 1 special token + BPE merges."""
    hidden_size: int = 64
    """`hidden_size`."""
    num_layers: int = 2
    """`num_hidden_layers`."""
    num_attention_heads: int = 4
    """`num_attention_heads`."""
    num_key_value_heads: int = 2
    """`num_key_value_heads` (GQA)."""
    head_dim: int = 16
    """`head_dim`."""
    intermediate_size: int = 128
    """`intermediate_size` of the SwiGLU MLP."""
    max_position_embeddings: int = 2048
    """`max_position_embeddings`; also SGLang's default context length for this model."""
    initializer_range: float = 0.2
    """Init std. Larger than Qwen3's 0.02 so that next-token distributions are peaked: greedy
    decoding then does not flip between two near-tied tokens on float rounding differences."""
    tie_word_embeddings: bool = False
    """`tie_word_embeddings`."""
    rms_norm_eps: float = 1e-6
    """`rms_norm_eps`."""
    rope_theta: float = 10000.0
    """`rope_theta` (transformers' default for Qwen3)."""
    num_experts: int = 0
    """0: dense Qwen3; > 0: Qwen3-MoE with this many experts in every layer (`num_experts`)."""
    tools: bool = False
    """The tokenizer for the tool demo (data/multiplication.py): its BPE also learns the tool-call format's
    text (the calculator call's JSON, the answer line) and TOOL_TOKENS are added tokens, so a call is ~20
    tokens instead of ~80 bytes. Off: the arithmetic tokenizer, bit for bit as before."""
    num_experts_per_tok: int = 2
    """`num_experts_per_tok` (MoE only)."""
    moe_intermediate_size: int = 48
    """`moe_intermediate_size`: one expert's MLP width (MoE only)."""
    norm_topk_prob: bool = True
    """`norm_topk_prob`: renormalise the top-k router probabilities (MoE only)."""
    seed: int = 1234
    """Seed of both the weight init and the synthetic tokenizer corpus."""


def arithmetic_corpus(num_lines: int, seed: int) -> list[str]:
    """Lines like "12+7=19": the synthetic text the tokenizer is trained on (and demo prompts)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice("+-*")
        value = a + b if op == "+" else a - b if op == "-" else a * b
        lines.append(f"{a}{op}{b}={value}")
    return lines


def train_tokenizer(vocab_size: int, seed: int, tools: bool = False):
    """Byte-level BPE (`tokenizers`) with one special token, eos = pad = <|endoftext|> (id 0); with `tools`
    also trained on the tool demo's text and with TOOL_TOKENS added (the last ids)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    extra = len(TOOL_TOKENS) if tools else 0
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - extra, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    corpus = arithmetic_corpus(20_000, seed)
    if tools:
        from megatron_gspo.data.multiplication import tool_corpus
        corpus += tool_corpus(5_000, seed)
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    if tools:
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    if tokenizer.get_vocab_size() > vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} tokens > vocab_size={vocab_size}")
    return tokenizer


def tiny_qwen3_config(spec: TinyQwen3Spec, **extra) -> Qwen3Config | Qwen3MoeConfig:
    """The transformers config of `spec` (Qwen3MoeConfig when `spec.num_experts`); `extra`: further
    config fields, verbatim (token ids, dtype)."""
    if spec.num_experts:
        extra.update(num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
                     moe_intermediate_size=spec.moe_intermediate_size, norm_topk_prob=spec.norm_topk_prob)
    return (Qwen3MoeConfig if spec.num_experts else Qwen3Config)(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings, initializer_range=spec.initializer_range,
        tie_word_embeddings=spec.tie_word_embeddings, rms_norm_eps=spec.rms_norm_eps, rope_theta=spec.rope_theta,
        **extra)


def make_tiny_tokenizer(spec: TinyQwen3Spec = TinyQwen3Spec()) -> PreTrainedTokenizerFast:
    """The tiny model's tokenizer, in memory (no model made): eos = pad = <|endoftext|>, CHAT_TEMPLATE."""
    fast = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(spec.vocab_size, spec.seed, spec.tools),
                                   eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_qwen3(out_dir: str | Path, spec: TinyQwen3Spec = TinyQwen3Spec()) -> Path:
    """Write config.json, model.safetensors (float32), tokenizer.json and tokenizer_config.json (and the
    chat template, CHAT_TEMPLATE, where transformers saves it).

    The same spec gives bit-identical weights and tokenizer on every call. `out_dir` must not exist or be
    empty (FileExistsError otherwise: files of an earlier model there would be left beside the new ones).
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"output directory {out} already exists and is not empty; refusing to overwrite it")
    out.mkdir(parents=True, exist_ok=True)
    fast = make_tiny_tokenizer(spec)
    eos_id = fast.convert_tokens_to_ids(EOS_TOKEN)
    config = tiny_qwen3_config(spec, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
                               dtype="float32")
    torch.manual_seed(spec.seed)
    model = (Qwen3MoeForCausalLM if spec.num_experts else Qwen3ForCausalLM)(config).to(torch.float32)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    return out
