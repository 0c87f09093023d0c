"""The in-process sampler's pieces on one process: counter-based Gumbel noise and truncated sampling.

Multi-process behaviour (TP/PP/EP/DP layouts, EOS, the model's log-probs) is in
tests/distributed/test_megatron_rollout.py.
"""
import math

import pytest
import torch

from megatron_gspo.config import SamplingConfig
from megatron_gspo.rollout.megatron.generator import MegatronGenerator
from megatron_gspo.rollout.megatron.sampling import check_sampling, gumbel_noise, sample_from_sharded_logits, sample_keys


def test_noise_of_a_vocab_shard_is_that_slice_of_the_full_vocab():
    keys = sample_keys(1234, "0", [(0, 0), (0, 1), (7, 3)], position=2)
    full = gumbel_noise(keys, torch.arange(512))
    assert torch.equal(gumbel_noise(keys, torch.arange(256, 512)), full[:, 256:])
    # Different rows, positions and seeds give different noise.
    assert not torch.equal(full[0], full[1])
    other = gumbel_noise(sample_keys(1234, "0", [(0, 0)], position=3), torch.arange(512))
    assert not torch.equal(other[0], full[0])
    assert not torch.equal(gumbel_noise(sample_keys(1, "0", [(0, 0)], 2), torch.arange(512))[0], full[0])


def test_noise_is_standard_gumbel():
    noise = gumbel_noise(sample_keys(0, "0", [(i, 0) for i in range(64)], 0), torch.arange(4096)).flatten()
    # Standard Gumbel: mean = Euler-Mascheroni 0.5772, variance pi^2 / 6 = 1.645 (262k draws: se ~0.003).
    assert abs(noise.mean().item() - 0.5772) < 0.02
    assert abs(noise.var().item() - math.pi ** 2 / 6) < 0.05


def test_sampled_frequencies_follow_the_tempered_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, 9.0])  # id 5 is Megatron's padding: never sampled
    rows = 20000
    settings = SamplingConfig(temperature=0.7)
    tokens, logprobs = sample_from_sharded_logits(logits.expand(rows, -1), sample_keys(3, "0", [(i, 0) for i in
                                                  range(rows)], 0), settings, vocab_size=5)
    expected = torch.softmax(logits[:5].double() / 0.7, 0)
    freq = torch.bincount(tokens, minlength=6).double() / rows
    assert freq[5] == 0
    assert torch.allclose(freq[:5], expected, atol=0.015), (freq, expected)
    assert torch.allclose(logprobs.double(), expected.log()[tokens], atol=1e-6)


def test_top_k_and_top_p_restrict_the_support_but_not_the_logprob():
    logits = torch.tensor([3.0, 2.9, 2.8, 0.0, -1.0, 1.0])  # softmax mass ~0.36, 0.33, 0.30, ...
    rows = 3000
    keys = sample_keys(5, "0", [(i, 0) for i in range(rows)], 0)
    tokens, logprobs = sample_from_sharded_logits(logits.expand(rows, -1), keys, SamplingConfig(top_k=2))
    assert set(tokens.tolist()) == {0, 1}
    # The log-prob is of the full tempered distribution (as SGLang reports it), not the truncated one.
    assert torch.allclose(logprobs.double(), torch.log_softmax(logits.double(), 0)[tokens], atol=1e-6)
    # top_p = 0.5 inside the top 4: mass before id 1 is ~0.36 <= 0.5, before id 2 ~0.69 > 0.5.
    tokens, _ = sample_from_sharded_logits(logits.expand(rows, -1), keys, SamplingConfig(top_k=4, top_p=0.5))
    assert set(tokens.tolist()) == {0, 1}
    # top_k=1 is greedy.
    tokens, _ = sample_from_sharded_logits(logits.expand(rows, -1), keys, SamplingConfig(top_k=1))
    assert set(tokens.tolist()) == {0}


def test_settings_refuse_top_p_without_top_k():
    with pytest.raises(ValueError, match="top_p < 1 needs sampling.top_k"):
        MegatronGenerator([], SamplingConfig(top_p=0.9), vocab_size=5, seed=0)
    with pytest.raises(ValueError, match="sampling.temperature must be > 0"):
        check_sampling(SamplingConfig(temperature=0.0))


def test_config_errors_for_the_megatron_backend(tmp_path):
    from megatron_gspo.config import load_config
    from megatron_gspo.training.preflight import preflight

    with pytest.raises(ValueError, match="sampling.top_p < 1 needs sampling.top_k >= 1 with rollout.backend=megatron"):
        preflight(load_config(None, ["model.preset=tiny_moe", "rollout.backend=megatron", "sampling.top_p=0.9"]))
    # A preset is a shape without a tokenizer: the prompts cannot be encoded.
    config = load_config(None, ["model.preset=tiny_moe", "rollout.backend=megatron", f"logging.run_dir={tmp_path}",
                                "data.train=examples/data/arithmetic/train.jsonl"])
    with pytest.raises(ValueError, match="model.hf_path is required to train"):
        preflight(config)


def test_stop_tokens_come_from_the_tokenizer_and_both_configs(tmp_path):
    import json
    from types import SimpleNamespace

    from megatron_gspo.rollout.megatron.generator import stop_token_ids

    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 9]}))
    assert stop_token_ids(str(tmp_path), SimpleNamespace(eos_token_id=2)) == (2, 5, 9)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "generation_config.json").unlink()
    with pytest.raises(ValueError, match="no EOS token id"):
        stop_token_ids(str(tmp_path), SimpleNamespace(eos_token_id=None))
