"""Weight sync into real SGLang servers (both of them, directly) by disk, tensor and broadcast.

After syncing perturbed weights, greedy outputs change to what transformers generates with the same
perturbed weights and the servers' log-probs match a float32 recompute; syncing the old weights back
restores the old outputs exactly (log-probs to float32 rounding).
"""
import copy

import pytest
import torch

from megatron_gspo.config import RolloutConfig

from megatron_gspo.config import SamplingConfig
from megatron_gspo.rollout.sglang.client import RolloutClient
from megatron_gspo.rollout.sglang.weight_sync import (BroadcastSync, ServerAdmin, connected, sync_by_tensor, sync_from_disk,
                                                     write_hf_checkpoint)
from megatron_gspo.samples import Prompt

from sglang_test_utils import API_KEY, recompute_logprobs

pytestmark = pytest.mark.sglang
PROMPTS = [Prompt(0, [259, 11, 23, 29]), Prompt(1, [300, 12]), Prompt(2, [45, 46, 47])]


@pytest.fixture(scope="module")
def weights(hf_model):
    original = {k: v.clone() for k, v in hf_model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in original.items()}
    perturbed_model = copy.deepcopy(hf_model)
    perturbed_model.load_state_dict(perturbed)
    return original, perturbed, perturbed_model


@pytest.fixture(scope="module")
def before(servers):
    """Greedy outputs of the original weights (every test restores them at its end)."""
    return {s.url: rollout(s.url, 0.0) for s in servers}


def rollout(url, temperature, n=1):
    groups, _ = RolloutClient([url], RolloutConfig(api_key=API_KEY)).generate_sync(
        PROMPTS, n, SamplingConfig(temperature=temperature, max_new_tokens=10))
    return [s for g in groups for s in g]


def greedy_hf(model, prompt):
    out = model.generate(torch.tensor([prompt.prompt_ids]), max_new_tokens=10, do_sample=False, eos_token_id=None)
    return out[0, len(prompt.prompt_ids):].tolist()


@pytest.mark.parametrize("transport", ["disk", "tensor", "broadcast"])
def test_sync_delivers_new_weights_and_restore_restores(servers, before, weights, tiny_model_dir, tmp_path,
                                                        transport, monkeypatch):
    original, perturbed, perturbed_model = weights
    urls = [s.url for s in servers]
    broadcast = None
    if transport == "broadcast":
        # As the trainer's rank 0 runs it: under torchrun, whose agent hosts the default group's store
        # (torch's tcp:// rendezvous then only connects to a store; the group's must be our own).
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
        broadcast = BroadcastSync(urls, api_key=API_KEY, timeout_s=60)
        broadcast.connect()

    def sync(state, version):
        if transport == "disk":
            folder = write_hf_checkpoint(state.items(), tmp_path / version, tiny_model_dir)
            with connected(urls, API_KEY) as admins:
                sync_from_disk(admins, folder, version)
        elif transport == "tensor":
            with connected(urls, API_KEY) as admins:
                sync_by_tensor(admins, state.items(), version, bucket_bytes=64 * 1024)  # several buckets
        else:
            broadcast.push(state.items(), version, bucket_bytes=64 * 1024)

    try:
        sync(perturbed, f"{transport}-1")
        expected = [greedy_hf(perturbed_model, p) for p in PROMPTS]
        for url in urls:
            with ServerAdmin(url, API_KEY) as admin:
                assert admin.weight_version() == f"{transport}-1"
            greedy = rollout(url, 0.0)
            assert [s.response_ids for s in greedy] != [s.response_ids for s in before[url]]
            assert [s.response_ids for s in greedy] == expected
            sampled = rollout(url, 1.0, n=2)
            assert all(s.weight_version == f"{transport}-1" for s in sampled)
            delta = torch.cat([(torch.tensor(s.rollout_logprobs) - recompute_logprobs(perturbed_model, s, 1.0)).abs()
                               for s in sampled])
            print(f"\n{transport} sync: |server - fp32 recompute| mean {delta.mean():.2e} max {delta.max():.2e}")
            assert delta.mean() < 1e-4 and delta.max() < 1e-3
        sync(original, f"{transport}-0")
        for url in urls:
            after = rollout(url, 0.0)
            assert [s.response_ids for s in after] == [s.response_ids for s in before[url]]
            # Same tokens; log-probs equal up to float32 rounding of a differently batched forward
            # (observed up to ~1e-6 between two runs with the same weights).
            for a, b in zip(after, before[url]):
                assert torch.allclose(torch.tensor(a.rollout_logprobs), torch.tensor(b.rollout_logprobs), atol=1e-5)
            assert all(s.weight_version == f"{transport}-0" for s in after)
    finally:
        if broadcast is not None:
            broadcast.close()
