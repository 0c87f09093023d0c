"""Shared by the sglang-tier tests: the servers' API key, prompts, a float32 log-prob recompute."""
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
