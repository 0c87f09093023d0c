"""Partial rollouts on real SGLang servers (rollout.partial_rollout): a weight push into requests in flight.

The servers pause the requests (retract), load the pushed weights and continue them. Every response
then says which of its tokens which weights generated: the tokens before the push must carry the old
weights' log-probs, the ones after it the new weights' (their prefix prefilled again under the new
weights), both checked against a float32 transformers recompute.
"""
import copy

import pytest
import torch

from megatron_gspo.config import RolloutConfig

from megatron_gspo.config import SamplingConfig
from megatron_gspo.rollout.sglang.client import RolloutClient
from megatron_gspo.samples import Prompt
from megatron_gspo.rollout.sglang.weight_sync import DiskSync, ServerAdmin
from sglang_test_utils import API_KEY, push_during_rollout, recompute_logprobs

pytestmark = pytest.mark.sglang


def test_a_push_into_requests_in_flight_continues_them_under_the_new_weights(servers, hf_model, tiny_model_dir,
                                                                            tmp_path):
    urls = [s.url for s in servers]
    original = {k: v.clone() for k, v in hf_model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in original.items()}
    new_model = copy.deepcopy(hf_model)
    new_model.load_state_dict(perturbed)
    client = RolloutClient(urls, RolloutConfig(api_key=API_KEY, partial_rollout=True, max_staleness=1))
    prompts = [Prompt(group_id=i, prompt_ids=[40 + i, 41, 42]) for i in range(4)]
    sync = DiskSync(urls, tmp_path / "weights", tiny_model_dir, api_key=API_KEY, pause_generation=True)
    try:
        samples, push_s = push_during_rollout(client, prompts, 2, SamplingConfig(temperature=1.0, max_new_tokens=400),
                                              lambda: sync.push(perturbed.items(), "partial-1"))
        cut = [s for s in samples if s.stale_prefix]
        print(f"\npush {push_s:.2f} s; {len(cut)} of {len(samples)} responses cut, stale prefixes "
              f"{[s.stale_prefix for s in cut]} of {[len(s.response_ids) for s in cut]} tokens")
        assert cut, "no response was in flight at the push"
        for s in samples:
            lp = torch.tensor(s.rollout_logprobs)
            if s.stale_prefix:
                assert s.weight_version == "partial-1"
            k = s.stale_prefix if s.weight_version == "partial-1" else len(s.response_ids)
            old_delta = (lp[:k] - recompute_logprobs(hf_model, s, 1.0)[:k]).abs()
            new_delta = (lp[k:] - recompute_logprobs(new_model, s, 1.0)[k:]).abs()
            assert old_delta.numel() == 0 or (old_delta.mean() < 1e-4 and old_delta.max() < 1e-3), old_delta.max()
            assert new_delta.numel() == 0 or (new_delta.mean() < 1e-4 and new_delta.max() < 1e-3), new_delta.max()
        # and the stale tokens were really the old weights' (the two models disagree on them)
        s = cut[0]
        assert (torch.tensor(s.rollout_logprobs[:s.stale_prefix])
                - recompute_logprobs(new_model, s, 1.0)[:s.stale_prefix]).abs().max() > 1e-2
    finally:
        sync.close()
        restore = DiskSync(urls, tmp_path / "restore", tiny_model_dir, api_key=API_KEY)
        restore.push(original.items(), "default")
        restore.close()
    for url in urls:
        with ServerAdmin(url, API_KEY) as admin:
            assert admin.weight_version() == "default"
