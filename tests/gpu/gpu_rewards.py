"""A reward with signal for a random tiny model, for the GPU training run (reward.fn=tests.gpu.gpu_rewards:NAME).

exact_match scores ~0 for every sample of an untrained model, so every group's advantages, the loss and
the gradient are zero and the backward proves little; this one varies between samples of a group.
"""


def text_parity(sample) -> float:
    """1.0 when the character codes of the response text sum to an odd number, else 0.0: a coin flip per
    sample for a random model (and one it can learn, being a function of the tokens it samples)."""
    return float(sum(map(ord, sample.response_text or "")) % 2)
