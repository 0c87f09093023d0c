"""Rollouts: SGLang server management, the async HTTP client, rewards, dynamic sampling, JSONL I/O.

Nothing here imports SGLang: servers run in their own environment (scripts/setup_sglang.sh) and the
trainer talks to them over HTTP.
"""
