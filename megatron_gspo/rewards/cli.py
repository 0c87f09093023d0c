"""`megatron-gspo score`: score one response with a reward function, the way training would.

For debugging a reward function before a run: the sample goes through a one-worker `RewardPool`,
so a hang or a crash shows up as it would in training (a timeout or an error), not as a stuck shell.
Output: a status line, then the reward alone as the last line of stdout (so scripts can read it
with `tail -n1`). A response the function could not parse ("unparsed", a 0 reward) says why in the
status line and exits 0; a timeout or an error prints its detail on stderr, 0.0 on stdout, and exits 1.

Wired into `megatron_gspo/cli.py` by `add_score_parser(sub)`; also runnable on its own as
`python -m megatron_gspo.rewards.cli score ...`.
"""
from __future__ import annotations

import argparse
import json
import sys


def add_score_parser(subparsers) -> None:
    """Register the `score` command on an argparse subparsers object."""
    p = subparsers.add_parser("score", help="score one response with a reward function (through a worker "
                              "process with the training time limit) and print the reward last")
    p.add_argument("--fn", default="math", help="built-in ('math', 'exact_match', 'final_answer') or "
                   "'package.module:function' (default: math)")
    p.add_argument("--answer", required=True, help="reference answer")
    p.add_argument("--response", required=True, help="the response text to score")
    p.add_argument("--prompt", help="prompt text, for functions that read it")
    p.add_argument("--metadata", type=_json_object, help="JSON object passed as sample.metadata")
    p.add_argument("--timeout-s", type=float, default=10.0, help="per-sample time limit (default: 10)")
    p.set_defaults(func=run_score)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(value).__name__}")
    return value


def run_score(args) -> int:
    from megatron_gspo.rewards.pool import RewardPool
    from megatron_gspo.samples import Sample

    sample = Sample(group_id=0, sample_index=0, prompt_ids=[], response_ids=[], rollout_logprobs=[],
                    finish_reason="stop", response_text=args.response, prompt=args.prompt,
                    answer=args.answer, metadata=args.metadata)
    with RewardPool(args.fn, workers=1, timeout_s=args.timeout_s) as pool:
        (score,) = pool.score([sample])
    if score.status in ("ok", "unparsed"):
        print(f"reward {args.fn}: {score.status}" + (f": {score.detail}" if score.detail else ""))
        print(score.value)
        return 0
    print(f"reward {args.fn}: {score.status}: {score.detail}", file=sys.stderr)
    print(score.value)
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_gspo.rewards.cli")
    sub = parser.add_subparsers(dest="command", required=True)
    add_score_parser(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, RuntimeError, OSError) as e:  # same contract as megatron_gspo/cli.py
        print(f"megatron-gspo {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
