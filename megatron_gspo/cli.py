"""`megatron-gspo <command>`: thin argument parsing, one call into the library per command.

Commands: `train` (the GSPO loop under torchrun; also one node of a multi-node run), `serve` (one SGLang
server in the foreground, for rollout nodes), `wait-servers` (until given servers answer), `plot`
(metrics PNG of a run directory), `tiny-model` (the demo's tiny Qwen3, optionally format-warm-started),
`rollout` (offline rollouts from SGLang servers into a samples JSONL file; plain single-turn), `score` (one response through a
reward function in the reward pool: the way to debug a verifier; rewards/cli.py), `make-data` (the demo
tasks' prompt files), `eval` (a checkpoint on the config's eval datasets; training/evaluate_checkpoint.py).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from pathlib import Path

from megatron_gspo.config import RolloutConfig, SamplingConfig
from megatron_gspo.rewards.cli import add_score_parser


_SAMPLING, _ROLLOUT = SamplingConfig(), RolloutConfig()
"""The config's defaults: the `rollout` command's defaults are these, not numbers of its own."""


def _rollout_parser(sub) -> None:
    p = sub.add_parser("rollout", help="sample G responses per prompt from SGLang servers into a JSONL file",
                       description="Roll out G samples per prompt (with log-probs and optional rewards).")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--servers", help="comma-separated URLs of running SGLang servers")
    where.add_argument("--launch", metavar="MODEL_DIR", help="start SGLang server(s) on this HF model directory")
    p.add_argument("--prompts", required=True, help="JSONL: one {prompt | prompt_ids, answer?} per line, or any "
                   "data.train file (message prompts through the tokenizer's chat template; .parquet too)")
    p.add_argument("--out", required=True, help="output JSONL, one sample per line")
    p.add_argument("--n", type=int, default=8, help="samples per prompt (G)")
    p.add_argument("--tokenizer", help="tokenizer directory for text prompts (default: the --launch directory)")
    p.add_argument("--reward", help="'exact_match', 'math', 'final_answer' or 'module:function' "
                   "(default: no rewards)")
    p.add_argument("--reward-timeout", type=float, default=10.0, help="seconds per sample")
    p.add_argument("--reward-workers", type=int, default=2, help="reward worker processes")
    s = p.add_argument_group("sampling (megatron_gspo.config.SamplingConfig, whose defaults these are)")
    s.add_argument("--temperature", type=float, default=_SAMPLING.temperature, help="0: greedy")
    s.add_argument("--top-p", type=float, default=_SAMPLING.top_p)
    s.add_argument("--top-k", type=int, default=_SAMPLING.top_k)
    s.add_argument("--max-new-tokens", type=int, default=_SAMPLING.max_new_tokens)
    s.add_argument("--stop-token-ids", default="", help="comma-separated token ids")
    s.add_argument("--stop", action="append", default=[], help="a string that ends a response (repeatable)")
    c = p.add_argument_group("client (megatron_gspo.config.RolloutConfig, whose defaults these are)")
    c.add_argument("--api-key", help="API key of the servers (sent as a Bearer token)")
    c.add_argument("--concurrency", type=int, default=_ROLLOUT.concurrency, help="requests in flight per server")
    c.add_argument("--request-timeout", type=float, default=_ROLLOUT.request_timeout_s,
                   help="seconds per /generate request")
    c.add_argument("--max-attempts", type=int, default=_ROLLOUT.max_attempts, help="tries per group over all servers")
    la = p.add_argument_group("--launch")
    la.add_argument("--num-servers", type=int, default=1)
    la.add_argument("--sglang-python", help="interpreter with SGLang (default: $MEGATRON_GSPO_SGLANG_PYTHON "
                                           "or .venv-sglang/bin/python)")
    la.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    la.add_argument("--dtype", help="server dtype, e.g. float32 (default: SGLang's auto)")
    la.add_argument("--max-total-tokens", type=int, help="KV-cache tokens per server (default: SGLang's own on cuda, "
                                                          "16384 on cpu)")
    la.add_argument("--log-dir", help="where server logs go")
    p.set_defaults(func=run_rollout)


def run_rollout(args) -> int:
    from megatron_gspo.rollout.sglang.client import RolloutClient
    from megatron_gspo.rollout.jsonl import read_prompt_file, write_samples
    from megatron_gspo.rewards.pool import RewardPool, check_batch
    from megatron_gspo.rollout.sglang.server import ServerConfig, default_sglang_python, launch_servers

    tokenizer_dir, tokenizer = args.tokenizer or args.launch, None
    if tokenizer_dir:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompts = read_prompt_file(args.prompts, tokenizer)
    sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                              max_new_tokens=args.max_new_tokens, stop=tuple(args.stop),
                              stop_token_ids=tuple(int(t) for t in args.stop_token_ids.split(",") if t.strip()))
    settings = RolloutConfig(concurrency=args.concurrency, request_timeout_s=args.request_timeout,
                             max_attempts=args.max_attempts, api_key=args.api_key,
                             max_total_tokens=args.max_total_tokens)
    with contextlib.ExitStack() as stack:
        if args.launch:
            server_config = ServerConfig(model_path=args.launch, settings=settings, device=args.device,
                                         dtype=args.dtype, python=args.sglang_python or default_sglang_python(),
                                         log_dir=args.log_dir)
            print(f"starting {args.num_servers} SGLang server(s) on {args.launch} ...", file=sys.stderr)
            servers = stack.enter_context(launch_servers(server_config, args.num_servers))
            urls = [s.url for s in servers]
        else:
            urls = [u.strip() for u in args.servers.split(",") if u.strip()]
        groups, stats = asyncio.run(RolloutClient(urls, settings).generate(prompts, args.n, sampling))
    samples = [s for g in groups for s in g]
    if args.reward:
        with RewardPool(args.reward, workers=args.reward_workers, timeout_s=args.reward_timeout) as pool:
            scores = pool.score(samples)
        check_batch(scores, samples, args.reward)
        for sample, score in zip(samples, scores):
            sample.reward = score.value
    write_samples(args.out, samples)
    summary = (f"{len(groups)} groups x {args.n} = {len(samples)} samples, {stats.response_tokens} tokens in "
               f"{stats.elapsed_s:.1f} s ({stats.tokens_per_s:.0f} tok/s) -> {args.out}")
    if args.reward:
        summary += (f"; mean reward {sum(s.reward for s in samples) / max(len(samples), 1):.3f}, "
                    f"{sum(s.status == 'unparsed' for s in scores)} unparsed")
    if stats.failures:
        summary += f"; {len(stats.failures)} failed requests retried, retired servers: {stats.retired or 'none'}"
    print(summary)
    return 0


def _train_parser(sub) -> None:
    p = sub.add_parser("train", help="run GSPO training (launches torchrun with the configured processes)",
                       description="Validate CONFIG, then run `torchrun -m megatron_gspo.training.loop` with "
                                   "parallel.tp * pp * cp * dp processes on this machine (training/launch.py: "
                                   "when ranks fail, the first one's exception is the last line). Multi-node: "
                                   "one `train --nnodes N --node-rank R` per node (scripts/slurm/gspo.sbatch).")
    p.add_argument("config", help="YAML config, e.g. examples/tiny_cpu.yaml")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. num_steps=10")
    m = p.add_argument_group("multi-node (one `train` per node, e.g. from srun: scripts/slurm/gspo.sbatch)")
    m.add_argument("--nnodes", type=int, default=1, help="nodes sharing the world of tp*pp*cp*dp ranks "
                   "evenly (default 1: every rank on this machine)")
    m.add_argument("--node-rank", type=int, default=0, help="this node's index, 0 .. nnodes-1")
    m.add_argument("--nproc-per-node", type=int, help="ranks per node, e.g. its GPUs: checked against the config "
                   "(nnodes * nproc-per-node must equal tp*pp*cp*dp); default world size / nnodes")
    m.add_argument("--master-addr", default="127.0.0.1", help="address of node rank 0 (rendezvous)")
    m.add_argument("--master-port", type=int, help="rendezvous port (default: a free one; required with --nnodes > 1)")
    p.set_defaults(func=run_train)


def run_train(args) -> int:
    from megatron_gspo.config import load_config
    from megatron_gspo.training.run_lock import HELD_BY_LAUNCHER_ENV, lock_run

    config = load_config(args.config, args.overrides)  # clear errors before anything starts
    world = config.parallel.world_size
    if args.nnodes < 1 or world % args.nnodes:
        raise ValueError(f"--nnodes {args.nnodes} must divide the world size tp*pp*cp*dp = {world} "
                         f"(set parallel.dp to use every GPU of the trainer nodes)")
    if args.nproc_per_node is not None and args.nproc_per_node * args.nnodes != world:
        layout = config.parallel
        ranks, model_ranks = args.nproc_per_node * args.nnodes, layout.tp * layout.pp * layout.cp
        hint = f"parallel.dp={ranks // model_ranks}" if ranks % model_ranks == 0 else "another layout"
        raise ValueError(f"{args.nnodes} node(s) x {args.nproc_per_node} ranks = {ranks}, but tp*pp*cp*dp = {world}: "
                         f"set {hint}")
    if not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--node-rank {args.node_rank} must be in [0, {args.nnodes})")
    if args.nnodes > 1 and args.master_port is None:
        raise ValueError("--master-port is required with --nnodes > 1 (every node must use the same one)")
    # One run per run directory: node rank 0 holds the lock until it exits (the other nodes share its file system),
    # and a second trainer is refused here at once, before the slow imports and preflight of _launch.
    if args.node_rank != 0:
        return _launch(config, args, ranks_env={})
    with lock_run(config):
        return _launch(config, args, ranks_env={HELD_BY_LAUNCHER_ENV: str(os.getpid())})


def _launch(config, args, ranks_env: dict[str, str]) -> int:
    """`train` after the checks: nothing to do, or preflight, then torchrun with `ranks_env` in its ranks."""
    from megatron_gspo.net import free_port
    from megatron_gspo.training.launch import run_torchrun
    from megatron_gspo.training.preflight import nothing_to_do, preflight

    world = config.parallel.world_size
    done = nothing_to_do(config)
    if done:
        print(f"megatron-gspo train: {done}")
        return 0
    preflight(config)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the ranks' environment is this process's
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.stdout.flush()
    # torchrun runs in this process: signals reach it, and it the ranks; a failure ends with its cause, one line
    return run_torchrun(["--nproc-per-node", str(world // args.nnodes), "--nnodes", str(args.nnodes),
                         "--node-rank", str(args.node_rank), "--master-addr", args.master_addr,
                         "--master-port", str(args.master_port or free_port()),
                         "-m", "megatron_gspo.training.loop", args.config, *args.overrides], env=ranks_env)


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="run one SGLang server for a training config, in the foreground",
                       description="Start one SGLang server on the config's model.hf_path (dtype, and the "
                                   "rollout.* server settings: concurrency, max_total_tokens, server_args, "
                                   "server_startup_timeout_s, ...), wait until it answers, and keep it running until "
                                   "SIGTERM/SIGINT. For jobs whose rollout nodes are not the trainer's "
                                   "(scripts/slurm/gspo.sbatch); give the trainer rollout.server_urls.")
    p.add_argument("config", help="the training config (YAML)")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides, as for `train`")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--host", default="0.0.0.0", help="address to bind (default: every interface)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--sglang-python", help="interpreter with SGLang, a path or a name on PATH (default: "
                                           "$MEGATRON_GSPO_SGLANG_PYTHON or .venv-sglang/bin/python)")
    p.add_argument("--log-dir", help="where the server log goes (default: RUN_DIR/sglang_logs/HOSTNAME)")
    p.add_argument("--sglang-args", default="", help="further `sglang.launch_server` arguments (after the config's "
                                                     "rollout.server_args), one string, e.g. '--tp-size 2'")
    p.set_defaults(func=run_serve)


def run_serve(args) -> int:
    import shlex
    import shutil
    import socket

    from megatron_gspo.config import load_config
    from megatron_gspo.rollout.sglang.serve import serve
    from megatron_gspo.rollout.sglang.server import ServerConfig, default_sglang_python

    config = load_config(args.config, args.overrides)
    python = args.sglang_python or default_sglang_python()
    log_dir = args.log_dir or str(Path(config.logging.run_dir, "sglang_logs", socket.gethostname()))
    server = ServerConfig(model_path=config.model.hf_path, settings=config.rollout, device=args.device,
                          dtype=config.rollout.server_dtype or config.model.dtype, python=shutil.which(python) or python,
                          host=args.host,
                          weight_version="0", return_routed_experts=config.gspo.routing_replay == "rollout",
                          log_dir=log_dir, extra_args=tuple(shlex.split(args.sglang_args)))
    return serve(server, args.port)


def _wait_servers_parser(sub) -> None:
    p = sub.add_parser("wait-servers", help="wait until SGLang servers answer /health_generate",
                       description="Exit 0 once every URL answers a one-token generation; exit 1 after --timeout.")
    p.add_argument("urls", nargs="+", help="server URLs (http://host:port), or comma-separated lists of them")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds")
    p.add_argument("--api-key", help="API key of the servers")
    p.set_defaults(func=run_wait_servers)


def run_wait_servers(args) -> int:
    from megatron_gspo.rollout.sglang.serve import wait_for_servers

    urls = [u for arg in args.urls for u in arg.split(",") if u]
    waited = wait_for_servers(urls, args.timeout, api_key=args.api_key)
    print(f"{len(urls)} rollout server(s) ready after {waited:.0f} s")
    return 0


def _plot_parser(sub) -> None:
    p = sub.add_parser("plot", help="RUN_DIR/metrics.png from RUN_DIR/metrics.jsonl")
    p.add_argument("run_dir")
    p.set_defaults(func=run_plot)


def run_plot(args) -> int:
    from megatron_gspo.training.metrics import plot

    print(plot(args.run_dir))
    return 0


def _tiny_model_parser(sub) -> None:
    p = sub.add_parser("tiny-model", help="write the tiny random Qwen3 of the CPU demo (HF format)")
    p.add_argument("out", help="output directory")
    p.add_argument("--warm-start", choices=("arithmetic", "long_addition", "long_addition_mixed", "tool_use"),
                   help="supervised format warm-start for this task, with random answers: reward at chance "
                   "(arithmetic: one random digit; long_addition, long_addition_mixed: the worked lines with random "
                   "digits; tool_use: the multiplication task's calculator calls with random operands, or a random "
                   "answer; megatron_gspo/dev/warm_start.py). tool_use makes the model with the tool demo's tokenizer "
                   "(dev/tiny_model.py TinyQwen3Spec.tools)")
    p.add_argument("--cold-start", type=int, metavar="STEPS", help="long_addition and long_addition_mixed only: "
                   "instead of the format warm start, STEPS supervised steps on the correct worked responses of "
                   "training problems (the test problems of make-data's default split are never shown), so the "
                   "model starts above chance, as the GSPO paper's cold-started models do; on the tiny dense model "
                   "200 steps give ~12%% sampled held-out accuracy, 250 ~58%% (benchmarks/moe_stability.py uses 250 "
                   "on its MoE: ~33%%)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--moe", action="store_true", help="a tiny Qwen3-MoE (4 experts, top-2) instead of the dense "
                   "Qwen3 (examples/tiny_moe_cpu.yaml): SGLang serves it on CPU in float32 with transformers' "
                   "log-probs and routing, and the in-process sampler (rollout.backend=megatron) runs it too")
    p.set_defaults(func=run_tiny_model)


def run_tiny_model(args) -> int:
    long_tasks = ("long_addition", "long_addition_mixed")
    if args.cold_start is not None and (args.warm_start not in long_tasks or args.cold_start < 1):
        raise SystemExit(f"tiny-model: --cold-start {args.cold_start} needs --warm-start long_addition (or "
                         "long_addition_mixed) and a positive number of steps")
    from megatron_gspo.dev.tiny_model import TinyQwen3Spec, make_tiny_qwen3
    from megatron_gspo.dev.warm_start import warm_start_format, warm_start_long_addition, warm_start_tool_use

    out = make_tiny_qwen3(args.out, TinyQwen3Spec(seed=args.seed, num_experts=4 if args.moe else 0,
                                                  tools=args.warm_start == "tool_use"))
    if args.warm_start == "arithmetic":
        digit_fraction = warm_start_format(out, seed=args.seed)
        print(f"format warm-start: {digit_fraction:.0%} of greedy answers are one digit")
    elif args.warm_start in long_tasks and args.cold_start is not None:
        format_rate, accuracy = warm_start_long_addition(out, seed=args.seed, correct_fraction=1.0,
                                                         steps=args.cold_start, task=args.warm_start)
        print(f"cold start: {format_rate:.0%} of greedy responses to held-out problems state an answer, "
              f"{accuracy:.0%} right")
    elif args.warm_start in long_tasks:
        format_rate, accuracy = warm_start_long_addition(out, seed=args.seed, task=args.warm_start)
        print(f"format warm-start: {format_rate:.0%} of greedy responses state an answer, {accuracy:.0%} right "
              f"(chance: {'1%' if args.warm_start == 'long_addition' else '5% of 1-digit sums, under 1% of wider'})")
    elif args.warm_start == "tool_use":
        rates = warm_start_tool_use(out, seed=args.seed)
        print(f"format warm-start: with the tool in the prompt {rates['call_rate']:.0%} of sampled episodes call it, "
              f"{rates['relay']:.0%} of those relay its result; right {rates['accuracy_with_tool']:.0%} with the tool, "
              f"{rates['accuracy_without_tool']:.0%} without (chance: ~1.5% and ~0%)")
    print(out)
    return 0


def _eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="evaluate a checkpoint on the config's eval datasets (no training)",
                       description="Score k samples per prompt of every eval.datasets entry on the weights in "
                                   "--checkpoint (SGLang servers launched on them): eval/NAME/mean@k, pass@k, ...")
    p.add_argument("config", help="YAML config with eval.datasets (and the reward, data keys, sampling)")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. eval.samples_per_prompt=32")
    p.add_argument("--checkpoint", required=True, help="a Hugging Face model directory or a Megatron checkpoint")
    p.set_defaults(func=run_eval)


def run_eval(args) -> int:
    import json

    from megatron_gspo.config import load_config
    from megatron_gspo.training.evaluate_checkpoint import evaluate_checkpoint

    results = evaluate_checkpoint(load_config(args.config, args.overrides), args.checkpoint)
    for key, value in results.items():
        print(f"{key}\t{value:.4f}")
    print(json.dumps(results))
    return 0


def _config_parser(sub) -> None:
    p = sub.add_parser("config", help="print the resolved configuration (what `train` would run), or the reference",
                       description="Print CONFIG with the overrides applied and every default filled in, as YAML: "
                                   "what `megatron-gspo train CONFIG [key=value ...]` would run. --reference prints "
                                   "every key with its type, default and meaning (docs/config.md).")
    p.add_argument("config", nargs="?", help="YAML config (none: the defaults)")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. num_steps=10")
    p.add_argument("--reference", action="store_true", help="print the configuration reference (Markdown)")
    p.set_defaults(func=run_config)


def run_config(args) -> int:
    import yaml

    if args.reference:
        from megatron_gspo.config_reference import reference_markdown
        print(reference_markdown(), end="")
        return 0
    from megatron_gspo.config import load_config, to_dict
    print(yaml.safe_dump(to_dict(load_config(args.config, args.overrides)), sort_keys=False), end="")
    return 0


def _make_data_parser(sub) -> None:
    p = sub.add_parser("make-data", help="write a demo task's prompt files (train.jsonl, test.jsonl)")
    p.add_argument("task", choices=("arithmetic", "long_addition", "long_addition_mixed", "multiplication"),
                   help="arithmetic: the 55 single-digit sums, 45 train / 10 test (reward exact_match); "
                        "long_addition: the 3240 two-digit sums a+b<=99, 3040 train / 200 test, answered "
                        "column by column in ~74 tokens (reward final_answer; megatron_gspo/data/long_addition.py); "
                        "long_addition_mixed: 1000 sums of two 1- to 4-digit numbers, 920 train / 80 test (20 per "
                        "width), worked the same way in 42 to 148 tokens (the response length spread); "
                        "multiplication: the 100 products of two two-digit numbers, 8 products (both orders) held "
                        "out to test.jsonl, for the calculator tool (reward final_answer; megatron_gspo/data/multiplication.py)")
    p.add_argument("out", help="output directory")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/test split")
    p.set_defaults(func=run_make_data)


def run_make_data(args) -> int:
    from megatron_gspo.data import (write_arithmetic_data, write_long_addition_data, write_long_addition_mixed_data,
                                    write_multiplication_data)

    write = {"arithmetic": write_arithmetic_data, "long_addition": write_long_addition_data,
             "long_addition_mixed": write_long_addition_mixed_data,
             "multiplication": write_multiplication_data}[args.task]
    for path in write(args.out, seed=args.seed):
        print(path)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with key=value overrides allowed after options too (`eval CONFIG --checkpoint D k=v`:
    argparse alone ends a positional list at the first option and refuses what follows it)."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any(arg.startswith("-") or "=" not in arg for arg in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    return args


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-gspo", description="GSPO RL post-training on Megatron-Core")
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _serve_parser(sub)
    _wait_servers_parser(sub)
    _plot_parser(sub)
    _tiny_model_parser(sub)
    _rollout_parser(sub)
    add_score_parser(sub)
    _make_data_parser(sub)
    _eval_parser(sub)
    _config_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, RuntimeError, OSError) as e:  # user-facing errors: one clear line, exit 1
        print(f"megatron-gspo {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
