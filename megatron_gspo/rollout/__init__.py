"""Rollouts: one step's prompts -> G samples each -> rewards, from one of two backends.

`protocol.py` is what both backends share, `backend.py` opens the configured one; `sglang/` holds
everything that speaks to SGLang (servers, HTTP client, routed experts, weight-sync transports) and
`megatron/` the in-process generator. `manager.py`, `batch_filling.py` and `scoring.py` drive either.

Nothing here imports SGLang: servers run in their own environment (scripts/setup_sglang.sh) and the
trainer talks to them over HTTP.
"""
