"""Rewards: verifiers (`Sample -> float`) and the process pool that runs them with a time limit.

`verifiers` holds the built-in functions ("math" on math-verify, "exact_match", "final_answer") and loads
user functions by "package.module:function"; `pool.RewardPool` scores samples in separate worker
processes (`worker`), so a hanging or crashing function costs one sample, not the run. Nothing
here imports torch: workers start in well under a second.
"""


class Unparsed(Exception):
    """Raised by a reward function when the response states no answer it can read. The sample scores 0
    and is counted as unparsed (reward/unparsed_fraction), not as an error: a policy that has not learnt
    the answer format yet is not a broken verifier, and a batch of such responses must not stop the run."""
