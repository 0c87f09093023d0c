"""The trainer's step on two processes: micro-batch invariance, on-policy s == 1, the rollout gap, learning.

usage: torchrun --nproc-per-node 2 train_step.py [tp=N] [pp=N] [cp=N] [ep=N] [model=dense|moe]
(1 and dense where absent; dp takes the other ranks: trainer_common.worker_args), e.g. no arguments (data
parallel over 2 ranks), `tp=2`, `pp=2`, `cp=2`, `ep=2 model=moe` (tiny Qwen3-MoE, experts over 2 ranks).
Five checks, in order, on one model: each trains it further; a sixth (fused vs per-mini-batch recompute)
and a seventh (packed rows vs one response per row) on fresh ones.
"""
from __future__ import annotations

import dataclasses
import math
import sys

import torch
import torch.distributed as dist

from megatron_gspo.config import CorrectionConfig, GSPOConfig
from megatron_gspo.loss.correction import mismatch_metrics, mismatch_sums
from megatron_gspo.model.gpt import model_process_groups
from megatron_gspo.parallel.groups import init_megatron
from megatron_gspo.training.forward_step import LossSettings
from megatron_gspo.parallel.groups import sequence_pad_multiple
from megatron_gspo.training.old_logprobs import old_logprobs_source
from megatron_gspo.training.packing import Response, pack_minibatch
from megatron_gspo.training.step import compute_logprobs, split_minibatches, train_on_batch

from megatron_gspo.model.presets import PRESETS

from checks import check, done
from trainer_common import FROM_ROLLOUT, RECOMPUTE, steps, synthetic_responses, tiny_model, worker_args

N = 16


def say(msg):
    if dist.get_rank() == 0:
        print(msg, flush=True)


def main():
    layout, options = worker_args(sys.argv[1:], model="dense")
    preset = {"dense": "tiny_dense", "moe": "tiny_moe"}[options.model]
    shape = PRESETS[preset]
    pgs = init_megatron(layout, seed=1)
    loss = LossSettings(algorithm="gspo", temperature=1.0, vocab_size=shape.vocab_size)
    responses = synthetic_responses(seed=3, n=N)

    model, optimizer, scheduler = microbatch_invariance(layout, pgs, preset, shape, loss, responses)
    on_policy_first_minibatch(model, optimizer, scheduler, loss, responses)
    train_rollout_gap(model, optimizer, loss, responses)
    fixed, wide = loss_decreases(model, optimizer, loss, responses)
    entropy(model, optimizer, loss, fixed, wide, shape, layout)
    fused_recompute(layout, pgs, preset, loss, responses)
    packed_rows(layout, pgs, preset, loss, responses)
    correction(layout, pgs, preset, loss, responses)
    done()


@check("microbatch invariance")
def microbatch_invariance(layout, pgs, preset, shape, loss, responses):
    """The gradient does not depend on the micro-batch split: one micro-batch vs. many."""
    norms, losses = [], []
    for budget in (4096, 40):
        model, optimizer, scheduler = tiny_model(layout, pgs=pgs, seed=5, preset=preset)
        groups = [g for opt in getattr(optimizer, "chained_optimizers", [optimizer])
                  for g in opt.optimizer.param_groups]
        assert groups and all(g["fused"] for g in groups), "CPU Adam should run torch's fused kernel"
        (rec,) = train_on_batch(model, optimizer, responses, steps(loss, max_tokens_per_microbatch=budget), RECOMPUTE,
                                pgs=pgs, scheduler=scheduler)
        norms.append(rec["train/grad_norm"]); losses.append(rec["loss/value"])
        say(f"budget {budget}: {rec['train/microbatches']:.0f} micro-batches, grad norm {rec['train/grad_norm']:.9f}")
    # MoE: the load-balancing aux loss is computed per micro-batch, so it (alone) depends on the split.
    assert abs(norms[0] - norms[1]) <= (1e-4 if shape.is_moe else 1e-5) * norms[0], norms
    assert abs(losses[0] - losses[1]) <= 1e-7, losses
    return model, optimizer, scheduler


@check("on-policy first mini-batch")
def on_policy_first_minibatch(model, optimizer, scheduler, loss, responses):
    """Recompute: mini-batch 1 is on-policy, so s_i == 1 exactly and nothing is clipped;
    mini-batch 2 was recomputed before step 1 moved the weights, so its ratios are not 1."""
    records = train_on_batch(model, optimizer, responses, steps(loss, 2, 64), RECOMPUTE,
                             pgs=model_process_groups(model), scheduler=scheduler)
    first, second = records
    assert first["loss/ratio_min"] == first["loss/ratio_max"] == 1.0, first
    assert first["loss/clipped_fraction_seq"] == 0.0 and first["loss/clipped_fraction_token"] == 0.0, first
    assert first["loss/abs_log_ratio_per_token"] == 0.0, first
    assert second["loss/ratio_min"] != 1.0 or second["loss/ratio_max"] != 1.0, second
    assert math.isfinite(first["train/grad_norm"]) and first["train/grad_norm"] > 0
    assert first["train/sequences"] == N / 2 and first["loss/sequences_empty"] in (0.0, 1.0)
    assert first["train/lr"] == 1e-3
    say(f"on-policy first mini-batch: ratio [{first['loss/ratio_min']}, {first['loss/ratio_max']}], "
        f"clipped 0; second: ratio [{second['loss/ratio_min']:.6f}, {second['loss/ratio_max']:.6f}]")


@check("train-rollout gap")
def train_rollout_gap(model, optimizer, loss, responses):
    """The train-vs-rollout gap: rollout log-probs = current ones shifted by +-1e-3 per sequence."""
    current = compute_logprobs(model, responses, loss, pgs=model_process_groups(model), max_tokens_per_microbatch=8192)
    shifted = [dataclasses.replace(r, rollout_logprobs=[lp + (1e-3 if i % 2 else -1e-3) for lp in lps])
               for i, (r, lps) in enumerate(zip(responses, current))]
    rec = train_on_batch(model, optimizer, shifted, steps(loss), RECOMPUTE, pgs=model_process_groups(model))[0]
    assert abs(rec["train/rollout_abs_delta_token"] - 1e-3) < 1e-5, rec
    assert abs(rec["train/rollout_abs_delta_seq"] - 1e-3) < 1e-5, rec
    assert rec["loss/ratio_min"] == rec["loss/ratio_max"] == 1.0   # recomputed old log-probs, not the rollout's
    say(f"train-rollout gap {rec['train/rollout_abs_delta_token']:.7f} per token, "
        f"{rec['train/rollout_abs_delta_seq']:.7f} per sequence (1e-3 injected)")


@check("loss decreases")
def loss_decreases(model, optimizer, loss, responses):
    """Learning: with fixed old log-probs (rollout mode, wide clip) each step lowers the loss -J."""
    current = compute_logprobs(model, responses, loss, pgs=model_process_groups(model), max_tokens_per_microbatch=8192)
    fixed = [dataclasses.replace(r, rollout_logprobs=lps) for r, lps in zip(responses, current)]
    wide = steps(dataclasses.replace(loss, eps_low=0.2, eps_high=0.2))
    history = [train_on_batch(model, optimizer, fixed, wide, FROM_ROLLOUT, pgs=model_process_groups(model))[0]["loss/value"]
               for _ in range(5)]
    say("loss over steps: " + ", ".join(f"{v:.6f}" for v in history))
    # Step 1 starts on-policy: s == 1, so -J = -(1/N) sum of A over non-empty responses (an empty
    # response counts in N but adds nothing; group advantages sum to 0, so this is A_empty / N).
    expected = -sum(r.advantage for r in responses if r.response_ids) / N
    assert abs(history[0] - expected) < 1e-6, (history, expected)
    assert all(b < a for a, b in zip(history[:3], history[1:3])), history
    assert all(b <= a for a, b in zip(history, history[1:])), history
    # The objective is bounded by the clip: -J >= -(1/N) (1.2 sum_{A>0} A + 0.8 sum_{A<0} A).
    bound = -sum((1.2 if r.advantage > 0 else 0.8) * r.advantage for r in responses if r.response_ids) / N
    assert history[-1] >= bound - 1e-6, (history, bound)
    return fixed, wide


@check("entropy")
def entropy(model, optimizer, loss, fixed, wide, shape, layout):
    """The recompute pass and the training forward (rollout mode) report the same token mean at the
    same weights (lr 0 keeps them), and it lies in (0, log V]."""
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    pgs = model_process_groups(model)
    from_recompute = train_on_batch(model, optimizer, fixed, steps(loss), RECOMPUTE, pgs=pgs)[0]["train/entropy"]
    from_training = train_on_batch(model, optimizer, fixed, wide, FROM_ROLLOUT, pgs=pgs)[0]["train/entropy"]
    assert abs(from_recompute - from_training) <= 1e-6 * from_recompute, (from_recompute, from_training)
    assert 0.0 < from_recompute <= math.log(shape.vocab_size), from_recompute
    # Every rank holds the whole model: a float64 reference from the logits.
    if layout.tp == layout.pp == layout.cp == 1:
        total, count = 0.0, 0
        with torch.no_grad():
            for r in fixed:
                ids = torch.tensor([r.prompt_ids + r.response_ids])
                logits = model[0](ids, torch.arange(ids.shape[1])[None], None)[0, :, :shape.vocab_size].double()
                logp = torch.log_softmax(logits / loss.temperature, -1)[len(r.prompt_ids) - 1:-1]
                total += float(-(logp.exp() * logp).sum())
                count += len(r.response_ids)
        assert abs(from_recompute - total / count) <= 1e-5 * from_recompute, (from_recompute, total / count)
    say(f"entropy {from_recompute:.6f} (recompute) vs {from_training:.6f} (training forward)")


@check("fused recompute")
def fused_recompute(layout, pgs, preset, loss, responses):
    """recompute="fused" (mini-batch 1 from its own forward, 2..K in one re-packed pass) trains like
    "per_minibatch" (one pass per mini-batch on its own micro-batches): the same records, to float noise,
    with mini-batch 1 on-policy in both. Rollout log-probs are given, so the gap metrics are compared too.
    (MoE: both run per mini-batch, routing being recorded there.)"""
    g = torch.Generator().manual_seed(11)
    with_rollout = [dataclasses.replace(r, rollout_logprobs=(-torch.rand(len(r.response_ids), generator=g)).tolist())
                    for r in responses]
    runs = {}
    for mode in ("fused", "per_minibatch"):
        model, optimizer, scheduler = tiny_model(layout, pgs=pgs, seed=5, preset=preset)
        source = old_logprobs_source(GSPOConfig(recompute=mode), routing=None)
        runs[mode] = train_on_batch(model, optimizer, with_rollout, steps(loss, 4, 48), source, pgs=pgs,
                                    scheduler=scheduler)
    for k, (a, b) in enumerate(zip(runs["fused"], runs["per_minibatch"])):
        assert a.keys() == b.keys(), (k, sorted(set(a) ^ set(b)))
        for key in a:
            if key.startswith("time/") or key.endswith("_per_s"):
                continue
            # Log-ratios are differences of float32 log-probs of size ~log V (~7.6 here), each rounded to
            # ~5e-7 and summed in another order by the other packing: 1e-6 absolute is that noise (one run
            # under load measured 1.2e-7 on abs_log_ratio_per_seq = 0.0104, over rel 1e-5).
            assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-6), (k, key, a[key], b[key])
    first = runs["fused"][0]
    assert first["loss/ratio_min"] == first["loss/ratio_max"] == 1.0 and first["loss/clipped_fraction_seq"] == 0.0, first
    assert runs["fused"][1]["loss/ratio_min"] != 1.0 or runs["fused"][1]["loss/ratio_max"] != 1.0
    say(f"fused recompute: {len(runs['fused'])} mini-batches agree with per-mini-batch recompute; "
        f"gap {first['train/rollout_abs_delta_token']:.6f}, entropy {first['train/entropy']:.6f}")


@check("packed rows")
def packed_rows(layout, pgs, preset, loss, responses):
    """parallel.pack_sequences: several responses per row, each attending only to itself at its own
    rotary positions, trains like one response per row: the same records (fused recompute, rollout
    gap, entropy, 2 optimizer steps) to float noise, the same recomputed log-probs, with less padding.
    (Pipeline parallelism refuses it at config load: tests/unit/test_config.py.)"""
    g = torch.Generator().manual_seed(13)
    with_rollout = [dataclasses.replace(r, rollout_logprobs=(-torch.rand(len(r.response_ids), generator=g)).tolist())
                    for r in responses]
    if layout.pp > 1:
        say("packed rows: not with pipeline parallelism")
        return
    multiple = sequence_pad_multiple(pgs)
    plan = pack_minibatch(with_rollout, dp_size=pgs.dp.size(), dp_rank=pgs.dp.rank(), max_tokens=64,
                          pad_multiple=multiple, rows="packed")
    assert any(mb.num_sequences > mb.tokens_BS.shape[0] for mb in plan.micro_batches), "nothing was packed"
    runs, logprobs = {}, {}
    for packed in (False, True):
        model, optimizer, scheduler = tiny_model(layout, pgs=pgs, seed=5, preset=preset)
        logprobs[packed] = compute_logprobs(model, with_rollout, loss, pgs=pgs, max_tokens_per_microbatch=64,
                                            pack_sequences=packed)
        runs[packed] = train_on_batch(model, optimizer, with_rollout, steps(loss, 2, 64, pack_sequences=packed), RECOMPUTE,
                                      pgs=pgs, scheduler=scheduler)
    for a, b in zip(logprobs[False], logprobs[True]):
        assert len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-5) for x, y in zip(a, b)), (a, b)
    # MoE: the load-balancing aux loss is computed per micro-batch, so (alone) it depends on the split:
    # the gradient to 1e-4 as in microbatch_invariance, and only mini-batch 1 (before any update) compares.
    moe = preset == "tiny_moe"
    for k, (a, b) in enumerate(zip(runs[False], runs[True])):
        assert a.keys() == b.keys(), (k, sorted(set(a) ^ set(b)))
        for key in a:
            if key.startswith("time/") or key.endswith("_per_s") or key in ("train/microbatches", "train/padding_fraction") \
                    or (moe and k > 0):
                continue
            rel = 1e-4 if moe and key == "train/grad_norm" else 1e-5
            assert math.isclose(a[key], b[key], rel_tol=rel, abs_tol=1e-6), (k, key, a[key], b[key])
    unpacked = sum(r["train/padding_fraction"] for r in runs[False]) / len(runs[False])
    packed = sum(r["train/padding_fraction"] for r in runs[True]) / len(runs[True])
    assert packed < unpacked, (packed, unpacked)
    say(f"packed rows: {len(runs[True])} mini-batches agree with one response per row; padding "
        f"{unpacked:.3f} -> {packed:.3f}, micro-batches {sum(r['train/microbatches'] for r in runs[False]):.0f} -> "
        f"{sum(r['train/microbatches'] for r in runs[True]):.0f}")



@check("correction")
def correction(layout, pgs, preset, loss, responses):
    """Train-inference correction (correction.weight=token, reject=geometric) through the trainer's step.
    mu == pi_old exactly (the sampler's log-probs are the recompute's own, same micro-batches): every weight 1,
    nothing rejected, kl_k3 0, and the step bitwise the uncorrected one (records and weights). Then mu != pi_old:
    each mini-batch's correction/* metrics equal those of its whole batch computed on every rank (exact over
    the layout's data/context/pipeline ranks)."""
    config = CorrectionConfig(weight="token", weight_cap=1.01, reject="geometric", reject_band=(0.997, 1.003))
    source = old_logprobs_source(GSPOConfig(recompute="per_minibatch"), routing=None)
    model, _, _ = tiny_model(layout, pgs=pgs, seed=5, preset=preset)
    minis = split_minibatches(responses, 2)
    pi_old = [lp for mini in minis for lp in compute_logprobs(model, mini, loss, pgs=pgs, max_tokens_per_microbatch=64)]
    exact = [dataclasses.replace(r, rollout_logprobs=lp) for r, lp in zip(responses, pi_old)]
    runs, weights = {}, {}
    for on in (False, True):
        model, optimizer, scheduler = tiny_model(layout, pgs=pgs, seed=5, preset=preset)
        settings = steps(loss, 2, 64, correction=config if on else CorrectionConfig())
        runs[on] = train_on_batch(model, optimizer, exact, settings, source, pgs=pgs, scheduler=scheduler)
        weights[on] = [p.detach().clone() for chunk in model for p in chunk.parameters()]
    for a, b in zip(runs[False], runs[True]):
        assert b["correction/kl_k3"] == 0 and b["correction/rejected_fraction"] == 0, b
        assert b["correction/weight_mean"] == b["correction/weight_max"] == 1.0, b
        for key in a:
            assert key.startswith("time/") or key.endswith("_per_s") or a[key] == b[key], (key, a[key], b[key])
    assert all(torch.equal(x, y) for x, y in zip(weights[False], weights[True])), "the weights differ"

    g = torch.Generator().manual_seed(17)
    noisy = [dataclasses.replace(r, rollout_logprobs=(torch.tensor(lp, dtype=torch.float64)
                                                      + 0.01 * torch.randn(len(lp), generator=g, dtype=torch.float64)).tolist())
             for r, lp in zip(responses, pi_old)]
    model, optimizer, scheduler = tiny_model(layout, pgs=pgs, seed=5, preset=preset)
    records = train_on_batch(model, optimizer, noisy, steps(loss, 2, 64, correction=config), source, pgs=pgs,
                             scheduler=scheduler)
    start = 0
    for record, mini in zip(records, split_minibatches(noisy, 2)):
        lengths = [len(r.response_ids) for r in mini]
        old = torch.tensor([x for lp in pi_old[start:start + len(mini)] for x in lp], dtype=torch.float64)
        start += len(mini)
        # as packing holds them: float32
        mu = torch.tensor([lp for r in mini for lp in r.rollout_logprobs], dtype=torch.float32).double()
        seq_T = torch.repeat_interleave(torch.arange(len(mini)), torch.tensor(lengths))
        want = mismatch_metrics(mismatch_sums(old, mu, torch.ones(len(old), dtype=torch.bool), seq_T, len(mini), config))
        for key, value in want.items():
            assert math.isclose(record[key], value, rel_tol=1e-6, abs_tol=1e-9), (key, record[key], value)
        assert 0 < record["correction/rejected_fraction"] < 1 and record["correction/truncated_fraction"] > 0, \
            {k: v for k, v in record.items() if k.startswith("correction/")}
    say(f"correction: bitwise with mu == pi_old; with mu = pi_old + noise, kl_k3 {records[0]['correction/kl_k3']:.2e}, "
        f"rejected {records[0]['correction/rejected_fraction']:.2f}, truncated {records[0]['correction/truncated_fraction']:.2f}")

if __name__ == "__main__":
    main()
    dist.barrier()
    dist.destroy_process_group()
