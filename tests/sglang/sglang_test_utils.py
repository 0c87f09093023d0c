"""Shared by the sglang-tier tests (and the GPU ones): the servers' API key, prompts, a float32 log-prob
recompute, a weight push while a rollout runs."""
import threading
import time

import torch

from megatron_gspo.dev.tiny_model import arithmetic_corpus
from megatron_gspo.samples import Prompt

API_KEY = "test-key"


def make_prompts(tokenizer, k, seed=0):
    texts = [line.split("=")[0] + "=" for line in arithmetic_corpus(k, seed)]
    return [Prompt(group_id=i, prompt_ids=tokenizer(t)["input_ids"], prompt=t) for i, t in enumerate(texts)]


def recompute_logprobs(model, sample, temperature):
    """log_softmax(logits / T) of each response token given everything before it (float32)."""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    P = len(sample.prompt_ids)
    logprobs = torch.log_softmax(logits[P - 1:-1] / temperature, dim=-1)
    return logprobs.gather(1, torch.tensor(sample.response_ids)[:, None])[:, 0]


def push_during_rollout(client, prompts, n, sampling, push, delay_s=0.5):
    """`client` rolls out n samples of each prompt in a background thread; `push()` runs `delay_s` after it
    started, while the requests generate. Returns every sample, group after group, once the rollout ended,
    and the seconds the push took."""
    result, push_s = {}, None
    rollout = threading.Thread(target=lambda: result.update(out=client.generate_sync(prompts, n, sampling)))
    rollout.start()
    try:
        time.sleep(delay_s)
        start = time.perf_counter()
        push()
        push_s = time.perf_counter() - start
    finally:
        rollout.join(timeout=300)
    assert "out" in result, "the rollout did not finish after the push"
    return [s for group in result["out"][0] for s in group], push_s
