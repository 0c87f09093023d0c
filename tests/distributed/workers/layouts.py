"""One launch per parallel layout: per-token log-probs and one full GSPO step, compared with TP1.

usage: torchrun --nproc-per-node N layouts.py WORKDIR NAME [tp=N] [pp=N] [cp=N] [ep=N] [microbatches=N]
                                                            [algorithm=gspo|gspo_token|grpo]
                                                            [variants=plain+correction+episodes]
(1, 1 micro-batch per DP rank, gspo and variants=plain where absent; dp takes the other ranks:
trainer_common.worker_args). `variants`: the steps this launch runs one after the other on the same processes,
each from the initial weights, each compared with the reference's step of that variant (a launch costs far
more than a step):
  plain       the batch as it is, `algorithm`;
  correction  the step also carries train-inference correction weights (geometric TIS, capped) and a token
              rejection, computed from sampler log-probs that differ from pi_old's by a fixed per-token noise
              (the same on every layout), as training/old_logprobs.py computes them on whole rows;
  episodes    every response is a two-turn episode, environment tokens (mask 0) between its turns, each turn's
              tokens with its own advantage (loss/advantages.py turn_advantages), trained with gspo_token.

NAME "reference" (one process, TP1): builds the tiny Qwen3-MoE from a seed, saves WORKDIR/init, and per
variant recomputes old log-probs (forward only), runs one GSPO step (loss, backward, SGD step) and saves
WORKDIR/VARIANT/reference.pt and the updated weights in WORKDIR/VARIANT/after.
Any other NAME loads WORKDIR/init into its layout, does the same, and checks against the reference:
per-token log-probs within 1e-5, the same loss and grad norm, and the same parameter update
(the reference's updated checkpoint is loaded resharded into this layout and compared shard by shard).
SGD without momentum makes the update proportional to the gradient, so a mis-scaled gradient shows.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state as ps
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_gspo.config import CorrectionConfig, ParallelConfig
from megatron_gspo.loss.correction import apply_correction
from megatron_gspo.loss.advantages import group_advantages, turn_advantages
from megatron_gspo.model.gpt import TINY_MOE, build_model, model_process_groups, transformer_config
from megatron_gspo.parallel.context_parallel import gather_from_cp
from megatron_gspo.parallel.groups import init_megatron
from megatron_gspo.training.forward_step import (LossSettings, logprobs_forward_step,
                                                 policy_forward_step)
from megatron_gspo.microbatch import MicroBatch

from checks import check, done
from trainer_common import worker_args

B, S, G = 8, 32, 4
# Per-sequence shift of the old log-probs: log s_i = -shift_i. Inside the band (|.| <= 1e-4) or well
# outside it (>= 1e-3), never near an edge, so layouts agree on every clip decision.
OLD_SHIFT = torch.tensor([0.0, 1e-4, -1e-4, 2e-3, -2e-3, 5e-5, -1e-3, 1e-3])


def global_batch(vocab: int, episodes: bool = False):
    """The same 8 sequences on every rank: prompt, response of varied length, right padding. `episodes`: each
    response a model turn, environment tokens, a model turn; per-token advantages of the turns' returns."""
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (B, S), generator=g)
    loss_mask = torch.zeros(B, S)
    rewards = torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 1])
    turn_rewards = [[0.5 * (i % 3 == 0), float(r) - 0.5 * (i % 3 == 0)] for i, r in enumerate(rewards.tolist())]
    per_turn = turn_advantages(turn_rewards, rewards.tolist(), G)
    advantages_BS = torch.zeros(B, S)
    for i in range(B):
        prompt = int(torch.randint(3, 9, (), generator=g))
        response = int(torch.randint(7 if episodes else 1, S - prompt, (), generator=g))
        tokens[i, prompt + response:] = 0
        loss_mask[i, prompt - 1: prompt + response - 1] = 1  # logits at s predict token s+1
        if episodes:  # environment tokens in the response's middle third: not trained
            env = slice(prompt - 1 + response // 3, prompt - 1 + 2 * response // 3)
            loss_mask[i, env] = 0
            advantages_BS[i, prompt - 1:env.start] = per_turn[i][0]
            advantages_BS[i, env.stop:prompt + response - 1] = per_turn[i][1]
    labels = torch.roll(tokens, -1, dims=1)
    advantages = advantages_BS if episodes else group_advantages(rewards, G).advantages_R
    return tokens, labels, loss_mask, advantages


VARIANTS = ("plain", "correction", "episodes")


def main() -> None:
    workdir, name = Path(sys.argv[1]), sys.argv[2]
    layout, options = worker_args(sys.argv[3:], microbatches=1, algorithm="gspo", variants="plain")
    variants = options.variants.split("+")
    if not set(variants) <= set(VARIANTS) or len(set(variants)) != len(variants):
        raise ValueError(f"variants={options.variants}: each of {', '.join(VARIANTS)} at most once, joined by +")
    pgs = init_megatron(layout, seed=1234)
    model, module, init_params = load_model(workdir, name, layout, pgs)
    for n, variant in enumerate(variants):
        if n:  # every variant starts from the initial weights
            load_init(workdir, module)
        algorithm = "gspo_token" if variant == "episodes" else options.algorithm
        step = gspo_step(model, layout.cp, options.microbatches, algorithm, correction=variant == "correction",
                         episodes=variant == "episodes")
        if name == "reference":
            save_reference(workdir / variant, module, step, variant == "correction")
        else:
            compare_with_reference(workdir / variant, f"{name} {variant}", layout, module, init_params, step)
    done()


def load_init(workdir: Path, module) -> None:
    """WORKDIR/init (the reference's initial weights) into `module`, resharded to its layout."""
    module.load_state_dict(dist_checkpointing.load(module.sharded_state_dict(), str(workdir / "init")))


def load_model(workdir: Path, name: str, layout: ParallelConfig, pgs):
    """The tiny MoE in `layout`: saved to WORKDIR/init by the reference, loaded from it by the others."""
    model = build_model(TINY_MOE, transformer_config(TINY_MOE, layout), pgs=pgs)
    (module,) = [chunk.module for chunk in model]
    if name == "reference":
        (workdir / "init").mkdir()
        dist_checkpointing.save(module.sharded_state_dict(), str(workdir / "init"))
    else:
        load_init(workdir, module)
    init_params = {n: p.detach().clone() for n, p in module.named_parameters()}
    return model, module, init_params


@dataclass
class StepResult:
    logprobs: torch.Tensor  # [rows, S] of this DP rank (zeros off the last pipeline stage)
    loss: torch.Tensor      # float64, the global batch's
    clipped: torch.Tensor   # float64, sequences clipped in the global batch
    grad_norm: float
    mine: slice             # this DP rank's rows of the global batch
    last_stage: bool
    corrected: tuple[int, int] = (0, 0)  # with correction: (sequences whose weight is capped, tokens rejected)


CORRECTION = CorrectionConfig(weight="geometric", weight_cap=1.001, reject="token", reject_band=(0.99, 1.01))
"""With SAMPLER_NOISE: some sequences' weights capped, some tokens rejected, most kept."""
SAMPLER_NOISE = 0.006
"""Scale of the sampler's per-token log-prob error (mu = pi_old + noise)."""


def gspo_step(model, cp: int, num_mb: int, algorithm: str, correction: bool = False,
              episodes: bool = False) -> StepResult:
    """Recompute old log-probs (forward only), then one GSPO step with SGD (lr 1, no momentum)."""
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="sgd", lr=1.0, sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.0), model)
    tokens, labels, loss_mask, advantages = global_batch(TINY_MOE.vocab_size, episodes)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = B // dp
    mine = slice(dp_rank * rows, (dp_rank + 1) * rows)
    mb_rows = rows // num_mb
    pgs = model_process_groups(model)
    settings = LossSettings(algorithm=algorithm, temperature=1.0, vocab_size=TINY_MOE.vocab_size)
    last_stage = ps.is_pipeline_last_stage()

    def micro_batches(old_logprobs, mask=loss_mask, weights=None):
        batch = MicroBatch(tokens[mine], labels[mine], mask[mine], old_logprobs, advantages[mine],
                           correction_BS=None if weights is None else weights[mine])
        return [batch.rows(i * mb_rows, (i + 1) * mb_rows) for i in range(num_mb)]

    schedule = get_forward_backward_func()
    run = dict(model=model, num_microbatches=num_mb, seq_length=S // cp, micro_batch_size=mb_rows)

    # 1. Old log-probs, recomputed forward-only (mini-batch 1 is on-policy).
    outputs = schedule(forward_step_func=logprobs_forward_step(settings, pgs=pgs),
                       data_iterator=iter(micro_batches(torch.zeros(rows, S))), forward_only=True, **run)
    logprobs = (torch.cat([gather_from_cp(o["logprobs"], pgs.cp) for o in outputs]) if last_stage
                else torch.zeros(rows, S))

    # 2. One GSPO step on old log-probs shifted per sequence (some sequences inside the band, some clipped).
    old_logprobs = logprobs + OLD_SHIFT[mine, None]
    mask, weights = loss_mask, None
    if correction:  # whole rows of pi_old on every rank of the last stage (the loss lives there)
        full = torch.zeros(B, S)
        full[mine] = old_logprobs
        if dp > 1:
            dist.all_reduce(full, group=ps.get_data_parallel_group())
        noise = SAMPLER_NOISE * torch.randn(B, S, generator=torch.Generator().manual_seed(11))
        seq_T = torch.arange(B).repeat_interleave(S)
        weights_T, kept_T = apply_correction(full.flatten(), (full + noise).flatten(), loss_mask.bool().flatten(),
                                             seq_T, B, CORRECTION)
        weights, mask = weights_T.view(B, S), kept_T.float().view(B, S)
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    outputs = schedule(forward_step_func=policy_forward_step(settings, pgs=pgs,
                                                             num_global_sequences=B, num_microbatches=num_mb),
                       data_iterator=iter(micro_batches(old_logprobs, mask, weights)), forward_only=False, **run)
    _, grad_norm, _ = optimizer.step()
    loss = torch.zeros((), dtype=torch.float64)
    clipped = torch.zeros((), dtype=torch.float64)
    if last_stage:
        loss += sum(o["loss_sum"].double() for o in outputs)
        clipped += sum(o["metrics"]["sequences_clipped"] for o in outputs)
        dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
        dist.all_reduce(loss, group=dp_cp)
        dist.all_reduce(clipped, group=dp_cp)
    loss /= B
    corrected = (0, 0)
    if weights is not None:
        capped = int(((weights == torch.tensor(CORRECTION.weight_cap)) & mask.bool()).any(1).sum())
        corrected = (capped, int((loss_mask.bool() & ~mask.bool()).sum()))
    return StepResult(logprobs, loss, clipped, grad_norm, mine, last_stage, corrected)


def save_reference(workdir: Path, module, step: StepResult, correction: bool) -> None:
    with check("the reference batch clips some sequences"):
        assert 0 < step.clipped < B, f"the reference batch must clip some sequences, clipped {step.clipped}"
        if correction:  # and the correction caps some, not all, sequences' weights and rejects some tokens
            capped, rejected = step.corrected
            assert 0 < capped < B and rejected > 0, step.corrected
    workdir.mkdir()
    torch.save({"logprobs": step.logprobs, "loss": step.loss, "grad_norm": step.grad_norm, "clipped": step.clipped},
               workdir / "reference.pt")
    (workdir / "after").mkdir()
    dist_checkpointing.save(module.sharded_state_dict(), str(workdir / "after"))
    print(f"reference loss={step.loss.item():.8f} grad_norm={step.grad_norm:.6f} clipped={step.clipped.item()}")


def compare_with_reference(workdir: Path, name: str, layout: ParallelConfig, module, init_params, step: StepResult):
    ref = torch.load(workdir / "reference.pt")
    where = f"[{name} rank {dist.get_rank()}]"
    # Log-probs, loss and clip counts exist on the last pipeline stage only.
    with check("per-token log-probs match the reference"):
        if step.last_stage:
            err = (step.logprobs - ref["logprobs"][step.mine]).abs().max().item()
            assert err <= 1e-5, f"{where} per-token log-probs differ by {err:.2e}"
    with check("loss matches the reference"):
        if step.last_stage:
            assert torch.isclose(step.loss, ref["loss"], rtol=1e-5, atol=1e-8), \
                f"{where} loss {step.loss} vs {ref['loss']}"
    with check("clipped sequences match the reference"):
        if step.last_stage:
            assert step.clipped == ref["clipped"], f"{where} clipped {step.clipped} vs {ref['clipped']}"
    with check("grad norm matches the reference"):
        assert abs(step.grad_norm - ref["grad_norm"]) <= 1e-5 * ref["grad_norm"], \
            f"{where} grad norm {step.grad_norm} vs {ref['grad_norm']}"
    with check("parameter update matches the reference"):
        worst = check_update(workdir, layout, module, init_params, where)
    print(f"{where} logprobs/loss/grad-norm/update match (loss={step.loss.item():.8f}, "
          f"grad_norm={step.grad_norm:.6f}, worst relative update error {worst:.1e})")


def check_update(workdir: Path, layout: ParallelConfig, module, init_params, where: str) -> float:
    """Every parameter moved as the reference's did (WORKDIR/after resharded into this layout)."""
    # A fresh config: the trained model's now holds schedule hooks bound to its DDP wrappers.
    reference_after = build_model(TINY_MOE, transformer_config(TINY_MOE, layout), pgs=model_process_groups([module]),
                                  wrap_ddp=False)[0]
    reference_after.load_state_dict(
        dist_checkpointing.load(reference_after.sharded_state_dict(), str(workdir / "after")))
    ref_params = dict(reference_after.named_parameters())
    worst = 0.0
    for n, p in module.named_parameters():
        update, ref_update = p.detach() - init_params[n], ref_params[n].detach() - init_params[n]
        scale = ref_update.abs().max().item()
        err = (update - ref_update).abs().max().item()
        assert err <= 1e-4 * scale + 1e-7, f"{where} update of {n} differs by {err:.2e} (scale {scale:.2e})"
        worst = max(worst, err / max(scale, 1e-12))
    return worst


if __name__ == "__main__":
    main()
    dist.barrier()
    dist.destroy_process_group()  # without it gloo can abort at exit
