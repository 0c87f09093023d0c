"""Per-token log-prob parity between a Hugging Face checkpoint (transformers) and a Megatron checkpoint.

Run on every rank of a torchrun launch (tools/check_hf_mcore_parity.py does the launching). The
Megatron model is built for the layout and loaded from the checkpoint; both models see the same
random token ids (tokenizer-independent) and score each next token in float32. The transformers
model runs on global rank 0 only and needs the whole model in that process's memory.

Shapes: B sequences, S positions, V this rank's vocabulary shard.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel.utils import is_pp_last_stage
from megatron.core.process_groups_config import ProcessGroupCollection
from transformers import AutoModelForCausalLM

from megatron_gspo.convert.hf_config import read_hf_config
from megatron_gspo.convert.load import load_weights
from megatron_gspo.loss.logprobs import vocab_parallel_logprobs
from megatron_gspo.model.gpt import build_model, transformer_config
from megatron_gspo.parallel.groups import init_megatron
from megatron_gspo.model.schedule import run_schedule


@dataclass(frozen=True)
class ParityReport:
    max_abs_diff: float
    mean_abs_diff: float
    argmax_agreement: float
    """Fraction of positions where both models' most likely next token is the same."""
    tokens: int

    def __str__(self) -> str:
        return (f"per-token log-prob |diff| max {self.max_abs_diff:.3e} mean {self.mean_abs_diff:.3e}, "
                f"argmax agreement {self.argmax_agreement:.4f} over {self.tokens} tokens")


def _vocab_parallel_argmax(logits_BSV, *, tp_group, vocab_size: int) -> torch.Tensor:
    """Global argmax ids [B, S] from vocabulary-sharded logits, padding columns excluded."""
    tp_rank, tp_size = dist.get_rank(tp_group), dist.get_world_size(tp_group)
    V = logits_BSV.shape[-1]
    valid = (torch.arange(V, device=logits_BSV.device) + tp_rank * V) < vocab_size
    best_BS, idx_BS = logits_BSV.float().masked_fill(~valid, float("-inf")).max(-1)
    gathered = [torch.empty_like(best_BS) for _ in range(tp_size)]
    dist.all_gather(gathered, best_BS, group=tp_group)
    winner_BS = torch.stack(gathered).argmax(0)  # first (lowest) shard on ties
    ids = [torch.empty_like(idx_BS) for _ in range(tp_size)]
    dist.all_gather(ids, idx_BS + tp_rank * V, group=tp_group)
    return torch.stack(ids).gather(0, winner_BS[None]).squeeze(0)


def megatron_scores(model, tokens_BS: torch.Tensor, vocab_size: int, *, pgs: ProcessGroupCollection):
    """(log-probs of tokens[:, 1:], argmax ids) [B, S-1] each on the last pipeline stage, else None."""
    B, S = tokens_BS.shape
    tp_group = pgs.tp
    labels_BS = torch.roll(tokens_BS, -1, dims=1)

    def loss_func(output_BSV):
        logprobs_BS = vocab_parallel_logprobs(output_BSV, labels_BS, tp_group=tp_group, vocab_size=vocab_size)
        argmax_BS = _vocab_parallel_argmax(output_BSV, tp_group=tp_group, vocab_size=vocab_size)
        return output_BSV.new_zeros(()), {"logprobs": logprobs_BS, "argmax": argmax_BS}

    def forward_step(data_iterator, chunk):
        tokens = next(data_iterator)
        positions = torch.arange(S, device=tokens.device).expand_as(tokens)
        return chunk(tokens, positions, None), loss_func

    with torch.no_grad():
        one_batch = SimpleNamespace(micro_batches=[tokens_BS], num_microbatches=1, seq_length=S, micro_batch_size=B)
        outputs = run_schedule(model, one_batch, forward_step, pgs=pgs, forward_only=True)
    if not is_pp_last_stage(pgs.pp):
        return None
    return outputs[0]["logprobs"][:, :-1], outputs[0]["argmax"][:, :-1]


def hf_scores(hf_dir: Path, tokens_BS: torch.Tensor):
    """transformers' float32 (log-probs of tokens[:, 1:], argmax ids) [B, S-1]."""
    device = tokens_BS.device
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        logits = model(tokens_BS).logits.float()[:, :-1]
    logprobs = torch.log_softmax(logits, -1).gather(-1, tokens_BS[:, 1:, None]).squeeze(-1)
    return logprobs, logits.argmax(-1)


def check_parity(hf_dir: str | Path, mcore_dir: str | Path, layout, *, batch: int = 2, seq_len: int = 256,
                 seed: int = 0) -> ParityReport | None:
    """Collective: build, load, score and compare. Returns the report on global rank 0, None elsewhere."""
    shape = read_hf_config(hf_dir)
    pgs = init_megatron(layout)
    model = build_model(shape, transformer_config(shape, layout), pgs=pgs, wrap_ddp=False)
    load_weights(model, mcore_dir)
    for chunk in model:
        chunk.eval()

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    tokens_BS = torch.randint(0, shape.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed))
    tokens_BS = tokens_BS.to(device)
    scores = megatron_scores(model, tokens_BS, shape.vocab_size, pgs=pgs)

    # Exactly one rank (last stage, TP rank 0, DP rank 0) contributes; a sum brings it to everyone.
    mine = scores is not None and pgs.tp.rank() == 0 and pgs.dp.rank() == 0
    shared = torch.zeros(2, batch, seq_len - 1, dtype=torch.float64, device=device)
    if mine:
        shared[0], shared[1] = scores[0].double(), scores[1].double()
    dist.all_reduce(shared)
    if dist.get_rank() != 0:
        return None
    ref_logprobs, ref_argmax = hf_scores(Path(hf_dir), tokens_BS)
    diff = (shared[0] - ref_logprobs.double()).abs()
    agree = (shared[1].long() == ref_argmax).double().mean().item()
    return ParityReport(diff.max().item(), diff.mean().item(), agree, diff.numel())
