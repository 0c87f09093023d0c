"""Rewards: verifiers (`Sample -> float`) and the process pool that runs them with a time limit.

`verifiers` holds the built-in functions ("math" on math-verify, "exact_match") and loads user
functions by "package.module:function"; `pool.RewardPool` scores samples in separate worker
processes (`worker`), so a hanging or crashing function costs one sample, not the run. Nothing
here imports torch: workers start in well under a second.
"""
