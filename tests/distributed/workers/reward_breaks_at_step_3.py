"""A reward function that works until step 3 (tests/distributed/workers/rollout_fails.py): the samples of weight
version "2", which step 3 rolls out after step 2's weight sync, raise, so the batch check fails (rewards/pool.py:
check_batch). Only rank 0 scores: the failure starts there."""


def score(sample) -> float:
    if sample.weight_version == "2":
        raise RuntimeError("deliberate failure at step 3")
    return float(sample.response_text.strip() == sample.answer)
