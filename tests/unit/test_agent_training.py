"""Multi-turn samples on the training side: per-turn advantages (GSPO-token), the GSPO-token == GSPO identity
when all reward is at the end, the loss mask through packing (padded and packed rows, CP parts) and every
metric that must leave the environment's tokens out; the rollout metrics; saved rollouts; the config rules."""
import json
import math
from types import SimpleNamespace

import pytest
import torch

from megatron_gspo.config import CorrectionConfig, load_config
from megatron_gspo.loss.advantages import group_advantages, spread_over_turns, turn_advantages
from megatron_gspo.loss.correction import MISMATCH_SUMS, mismatch_sums
from megatron_gspo.loss.policy import policy_loss
from megatron_gspo.rollout.batch_filling import ScoredBatch, episode_metrics
from megatron_gspo.rollout.jsonl import read_samples, write_rollouts, write_samples
from megatron_gspo.rollout.protocol import RolloutStats
from megatron_gspo.samples import Sample, ToolCall, Turn
from megatron_gspo.training.forward_step import _entropy_sum
from megatron_gspo.training.old_logprobs import _gap_sums
from megatron_gspo.training.packing import pack_minibatch, responses_from_samples


def episode(group, index, turns, env, reward_per_turn, seed):
    """A multi-turn Sample: `turns` model turns of the given lengths, `env` environment tokens after each turn
    but the last; its turns' rewards `reward_per_turn`. Rollout log-probs random (placeholders 0 on env)."""
    gen = torch.Generator().manual_seed(seed)
    response, logprobs, mask, spans = [], [], [], []
    for k, n in enumerate(turns):
        spans.append(Turn(len(response), len(response) + n, "stop", reward_per_turn[k]))
        response += torch.randint(3, 90, (n,), generator=gen).tolist()
        logprobs += (-torch.rand(n, generator=gen) * 3).tolist()
        mask += [1] * n
        if k < len(turns) - 1:
            response += torch.randint(3, 90, (env,), generator=gen).tolist()
            logprobs += [0.0] * env
            mask += [0] * env
    s = Sample(group_id=group, sample_index=index, prompt_ids=[1, 2, 3][:1 + index % 3], response_ids=response,
               rollout_logprobs=logprobs, finish_reason="stop", loss_mask=mask, turns=spans)
    s.reward = sum(reward_per_turn)
    return s


# ---- per-turn advantages -----------------------------------------------------------------------------

def test_turn_advantages_by_hand():
    # One group of 3, population std, eps 0. Rewards per turn and their returns R_ik (sum from turn k on):
    #   s0: [0.5, 0.5]  r = 1   R = [1, 0.5]
    #   s1: [0, 0, 0]   r = 0   R = [0, 0, 0]
    #   s2: [1, -1]     r = 0   R = [0, -1]
    # mean r = 1/3, std r = sqrt(((2/3)^2 + 2 (1/3)^2) / 3) = sqrt(2)/3, so A = (R - 1/3) * 3 / sqrt(2):
    a = turn_advantages([[0.5, 0.5], [0.0, 0.0, 0.0], [1.0, -1.0]], [1.0, 0.0, 0.0], 3, std="population", eps=0.0)
    s = math.sqrt(2)
    expected = [[2 / s, 0.5 / s], [-1 / s] * 3, [-1 / s, -4 / s]]
    for got, want in zip(a, expected):
        assert got == pytest.approx(want, rel=1e-6)
    # std none: R - mean
    assert turn_advantages([[0.5, 0.5], [0.0], [1.0, -1.0]], [1.0, 0.0, 0.0], 3, std=None)[2] == \
        pytest.approx([-1 / 3, -4 / 3])
    # A group whose episode rewards are equal gets 0, though its turns' rewards differ (its std is 0).
    assert turn_advantages([[1.0, 0.0], [0.0, 1.0]], [1.0, 1.0], 2) == [[0.0, 0.0], [0.0, 0.0]]
    assert spread_over_turns([2.0, -1.0], [(0, 2), (4, 5)], 6) == [2.0, 2.0, 0.0, 0.0, -1.0, 0.0]


def test_all_reward_at_the_end_gives_gspo_advantages_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    rewards = (torch.rand(12, generator=gen) * 3 - 1).tolist()
    turns = [1 + i % 3 for i in range(12)]
    per_turn = [[0.0] * (k - 1) + [r] for k, r in zip(turns, rewards)]
    for std in ("sample", "population", None):
        ours = turn_advantages(per_turn, rewards, 4, std=std)
        theirs = group_advantages(torch.tensor(rewards), 4, std=std).advantages_R.tolist()
        assert [set(a) for a in ours] == [{b} for b in theirs]   # every turn's value is the sequence's, exactly


# ---- GSPO-token == GSPO on multi-turn batches ---------------------------------------------------------

def multi_turn_batch(gspo_token: bool, reward_at_end: bool = True):
    """8 episodes (2 groups of 4) through with_advantages' math and packing: the packed micro-batch."""
    samples = []
    for i in range(8):
        r = [0.0, 1.0 * (i % 4 == 1) + 0.5 * (i % 4 == 2)] if reward_at_end else [0.3 * (i % 2), 0.5 * (i % 3 == 0)]
        samples.append(episode(i // 4, i % 4, turns=(3 + i % 2, 2 + i % 3), env=2 + i % 2, reward_per_turn=r,
                               seed=i))
    rewards = [s.reward for s in samples]
    if gspo_token:
        per_turn = turn_advantages([[t.reward for t in s.turns] for s in samples], rewards, 4)
        advantages = [spread_over_turns(a, [(t.start, t.end) for t in s.turns], len(s.response_ids))
                      for s, a in zip(samples, per_turn)]
    else:
        advantages = group_advantages(torch.tensor(rewards), 4).advantages_R
    (mb,) = pack_minibatch(responses_from_samples(samples, advantages), dp_size=1, dp_rank=0, max_tokens=4096,
                           pad_multiple=4).micro_batches
    return mb


def loss_and_grad(mb, algorithm, log_ratio_BS, env_noise: float = 0.0):
    """policy_loss of the micro-batch with logp = old + log_ratio (+ noise on every non-trained position)."""
    logp = (mb.old_logprobs_BS + log_ratio_BS + env_noise * (1 - mb.loss_mask_BS)).flatten().requires_grad_()
    adv = mb.advantages.flatten() if mb.advantages.dim() == 2 else mb.advantages
    rows, length = mb.loss_mask_BS.shape
    loss, n, metrics = policy_loss(logp, mb.old_logprobs_BS.flatten(), adv, mb.loss_mask_BS.flatten(),
                                   torch.arange(rows + 1) * length, algorithm=algorithm)
    loss.backward()
    return loss.detach(), logp.grad.view(rows, length), metrics


def test_gspo_token_equals_gspo_on_multi_turn_episodes_with_the_reward_at_the_end():
    seq_mb, tok_mb = multi_turn_batch(gspo_token=False), multi_turn_batch(gspo_token=True)
    assert torch.equal(seq_mb.loss_mask_BS, tok_mb.loss_mask_BS)
    mask = tok_mb.loss_mask_BS.bool()
    # per token, each trained position carries its sequence's advantage, bit for bit
    assert torch.equal(tok_mb.advantages[mask], seq_mb.advantages[:, None].expand_as(mask)[mask])
    # sequence ratios around the clip band (3e-4 / 4e-4): rows 1 and 5 inside it, the others outside
    gen = torch.Generator().manual_seed(3)
    shift = torch.tensor([6e-4, 1e-4, -8e-4, 5e-4, -6e-4, -1e-4, 9e-4, -5e-4])[:, None]
    log_ratio = shift + 1e-4 * torch.randn(mask.shape, generator=gen)
    loss_a, grad_a, m_a = loss_and_grad(seq_mb, "gspo", log_ratio)
    loss_b, grad_b, m_b = loss_and_grad(tok_mb, "gspo_token", log_ratio)
    # equal up to float32 rounding: the sequence terms (~0.1-1) cancel to a loss of ~1e-4
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad_b, grad_a, rtol=1e-5, atol=1e-9)
    assert m_a["sequences_clipped"] == m_b["sequences_clipped"] and m_a["tokens_clipped"] == m_b["tokens_clipped"]
    assert 0 < m_a["sequences_clipped"] < 6   # clipping decided something (rows 0 and 3 have A = 0)
    assert (grad_a[~mask] == 0).all()       # environment tokens and prompts get no gradient
    # Per-turn rewards: GSPO-token's advantages now differ by turn, and the losses part.
    tok_mb2 = multi_turn_batch(gspo_token=True, reward_at_end=False)
    assert len(set(tok_mb2.advantages[0][tok_mb2.loss_mask_BS[0].bool()].tolist())) == 2


@pytest.mark.parametrize("algorithm", ["gspo", "gspo_token", "grpo"])
def test_environment_tokens_change_nothing_in_the_loss(algorithm):
    mb = multi_turn_batch(gspo_token=algorithm == "gspo_token")
    log_ratio = 2e-4 * torch.randn(mb.loss_mask_BS.shape, generator=torch.Generator().manual_seed(1))
    loss_a, grad_a, m_a = loss_and_grad(mb, algorithm, log_ratio)
    loss_b, grad_b, m_b = loss_and_grad(mb, algorithm, log_ratio, env_noise=5.0)
    assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b)
    # |y_i| counts the model's tokens only: the tokens metric is the mask's sum, not the responses' lengths
    assert m_a["tokens"] == mb.loss_mask_BS.sum()


# ---- the mask through packing, CP and the metrics ----------------------------------------------------

def test_loss_mask_in_padded_and_packed_rows_and_cp_parts():
    samples = [episode(0, i, turns=(2, 3), env=2, reward_per_turn=[0.0, float(i)], seed=i) for i in range(4)]
    responses = responses_from_samples(samples, [0.5] * 4)
    for rows in ("padded", "packed"):
        packed = pack_minibatch(responses, dp_size=1, dp_rank=0, max_tokens=4096, pad_multiple=4, rows=rows)
        for mb, order, places in zip(packed.micro_batches, packed.rows, packed.places):
            for i, (row, start) in zip(order, places):
                s = samples[i]
                first = start + len(s.prompt_ids) - 1   # the position whose label is response token 0
                got = mb.loss_mask_BS[row, first:first + len(s.response_ids)].tolist()
                assert got == [float(m) for m in s.loss_mask] == [1, 1, 0, 0, 1, 1, 1]
            # context parallelism splits the mask with the rows: the CP parts hold it all, once
            parts = [mb.for_cp_rank(2, r).loss_mask_BS for r in range(2)]
            assert sum(p.sum() for p in parts) == mb.loss_mask_BS.sum() == 5 * len(order)


def test_gap_mismatch_and_entropy_leave_environment_tokens_out():
    mb = multi_turn_batch(gspo_token=False)
    mask = mb.loss_mask_BS
    gen = torch.Generator().manual_seed(0)
    train = mb.old_logprobs_BS + 0.01 * torch.randn(mask.shape, generator=gen)
    garbage = torch.where(mask.bool(), train, torch.full_like(train, -50.0))   # env: far from the 0.0 placeholder
    assert torch.equal(_gap_sums(train, mb.old_logprobs_BS, mask), _gap_sums(garbage, mb.old_logprobs_BS, mask))
    seq_T, n = mb.sequence_index()
    sums = [mismatch_sums(x.flatten(), mb.old_logprobs_BS.flatten(), mask.flatten(), seq_T, n, CorrectionConfig())
            for x in (train, garbage)]
    assert torch.equal(sums[0], sums[1]) and sums[0][MISMATCH_SUMS.index("tokens")] == mask.sum()
    entropy = torch.rand(mask.shape, generator=gen)
    assert _entropy_sum(entropy, mb) == _entropy_sum(torch.where(mask.bool(), entropy, 1e6), mb)


def test_rollout_metrics_count_the_models_tokens_and_the_episodes():
    samples = [episode(0, i, turns=(2, 3), env=4, reward_per_turn=[0.0, float(i % 2)], seed=i) for i in range(4)]
    samples[0].tool_calls = [ToolCall(0, "calc", {}, "5"), ToolCall(0, "calc", {}, None, "calc raised X")]
    stats = RolloutStats(episodes=4, turns=8, tool_calls=2, tool_errors=1, env_tokens=16, response_tokens=20)
    batch = ScoredBatch(groups=[samples], rollout_stats=[stats], generated_rewards=[[s.reward for s in samples]])
    m = batch.metrics()
    assert m["rollout/response_length_mean"] == 5 and m["rollout/response_length_max"] == 5   # 2 + 3, not 9
    assert (m["rollout/turns_mean"], m["rollout/tool_calls_mean"], m["rollout/tool_errors"]) == (2.0, 0.5, 1.0)
    assert m["rollout/env_token_fraction"] == 16 / 36
    assert episode_metrics([RolloutStats()]) == {}   # single-turn runs log none of them


def test_saved_rollouts_and_samples_files(tmp_path):
    from megatron_gspo.dev.tiny_model import make_tiny_tokenizer
    tok = make_tiny_tokenizer()
    s = episode(3, 1, turns=(2, 1), env=2, reward_per_turn=[0.0, 1.0], seed=0)
    s.tool_calls = [ToolCall(0, "calc", {"expression": "1+1"}, "2")]
    s.storage, s.prompt = {"moves": 2}, "1+1="
    path = write_rollouts(tmp_path / "rollouts" / "step_000004.jsonl", [s], [[0.5, 0.5, 0.0, 0.0, -1.0]], tok, 4)
    assert path.name == "step_000004.jsonl" and not list(path.parent.glob("*.partial"))
    (row,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert row["step"] == 4 and row["prompt"] == "1+1=" and row["reward"] == 1.0 and row["advantage"] == [0.5, -1.0]
    assert row["loss_mask"] == [1, 1, 0, 0, 1] and row["response_ids"] == s.response_ids
    assert row["rollout_logprobs"] == s.rollout_logprobs and row["trajectory"] == tok.decode(s.response_ids)
    assert [(t["start"], t["end"], t["reward"]) for t in row["turns"]] == [(0, 2, 0.0), (4, 5, 1.0)]
    assert row["turns"][1]["text"] == tok.decode(s.response_ids[4:5])
    assert row["tool_calls"] == [{"turn": 0, "name": "calc", "arguments": {"expression": "1+1"}, "result": "2",
                                  "error": None}] and row["storage"] == {"moves": 2}
    write_samples(tmp_path / "samples.jsonl", [s])
    assert read_samples(tmp_path / "samples.jsonl") == [s]


def test_with_advantages_gives_gspo_token_per_turn_returns():
    from megatron_gspo.training.loop import with_advantages
    samples = [episode(0, i, turns=(2, 1), env=1, reward_per_turn=[0.5 * (i == 0), 1.0 * (i < 2)], seed=i)
               for i in range(4)]
    batch = SimpleNamespace(scored=ScoredBatch(groups=[samples]))
    overrides = ["model.hf_path=x", "gspo.group_size=4", "gspo.prompts_per_step=1", "gspo.num_minibatches=1"]
    tok = with_advantages(batch, load_config(None, overrides + ["gspo.algorithm=gspo_token"]))
    seq = with_advantages(batch, load_config(None, overrides))
    # rewards 1.5, 1, 0, 0: sample 0's first turn has return 1.5 (its advantage), its second 1.0
    expected = turn_advantages([[0.5, 1.0], [0.0, 1.0], [0.0, 0.0], [0.0, 0.0]], [1.5, 1.0, 0.0, 0.0], 4)
    assert tok[0].advantage == [expected[0][0]] * 2 + [0.0] + [expected[0][1]]
    assert seq[0].advantage == pytest.approx(group_advantages(torch.tensor([1.5, 1.0, 0.0, 0.0]), 4).advantages_R[0])
    assert tok[0].loss_mask == [1, 1, 0, 1]


# ---- configuration -----------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (["rollout.backend=megatron", "model.preset=tiny_dense", "model.hf_path=none"], "must be sglang with rollout.tools"),
    (["rollout.max_staleness=1", "gspo.old_logprobs=rollout", "rollout.partial_rollout=true"],
     "partial_rollout is not supported with rollout.tools"),
    (["gspo.routing_replay=rollout"], "must not be rollout with rollout.tools"),
    (["rollout.max_turns=0"], "rollout.max_turns must be >= 1"),
    (["rollout.tool_timeout_s=0"], "rollout.tool_timeout_s must be > 0"),
    (["rollout.tools=[calculator]"], "must name functions as package.module:function"),
])
def test_config_refuses_what_episodes_cannot_do(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, ["model.hf_path=x", "rollout.tools=[m:f]", *overrides])


def test_config_keys_of_episodes():
    c = load_config(None, ["model.hf_path=x", "rollout.episode_fn=m:f", "reward.fn=none", "logging.save_rollouts=5",
                           "rollout.max_staleness=1", "gspo.old_logprobs=rollout"])
    assert c.rollout.episodes and c.logging.save_rollouts_every == 5
    assert load_config(None, ["model.hf_path=x", "logging.save_rollouts=true"]).logging.save_rollouts_every == 1
    assert not load_config(None, ["model.hf_path=x"]).rollout.episodes
    with pytest.raises(ValueError, match="may be none only with rollout.episode_fn"):
        load_config(None, ["model.hf_path=x", "reward.fn=none", "rollout.tools=[m:f]"])
