"""Every setting of a training run, as frozen dataclasses; loaded from YAML plus `key.sub=value` overrides.

    config = load_config("examples/tiny_cpu.yaml", ["gspo.eps_low=2e-4", "num_steps=10"])

Values are parsed by the field's type (`bool`: true/false, `X | None`: none/null, tuples: comma
separated), checked once when the dataclass is built (a `ValueError` naming the field, e.g.
"gspo.eps_low must be in [0, 1), got -1.0"), and unknown keys are rejected with the nearest valid name.
Paths and names that only the package knows (model presets, reward functions, data files) are not touched here:
`megatron_gspo.training.preflight` checks them before work starts. This module imports nothing from
the package, so every layer may take its section of the config.

One object per concept, passed down unchanged, and the one place each setting and its default is declared:
`ParallelConfig` is the parallel layout that `parallel.groups.init_megatron` and the model builder take;
`SamplingConfig` is what both rollout backends and the offline `megatron-gspo rollout` command sample with;
`RolloutConfig` is what the SGLang client and the servers a run launches are built from; `GSPOConfig` the
algorithm. Lower-level objects are built from these in one place each and declare no defaults of their own.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

import yaml


def _check(ok: bool, name: str, requirement: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"{name} {requirement}, got {value!r}")


def _positive(section: str, obj, *names: str) -> None:
    for n in names:
        _check(getattr(obj, n) >= 1, f"{section}.{n}", "must be >= 1", getattr(obj, n))


@dataclass(frozen=True)
class ModelConfig:
    hf_path: str | None = None
    """Hugging Face model directory (config.json, tokenizer, safetensors): the model's shape and
    initial weights, and what SGLang serves. Exactly one of hf_path and preset."""
    preset: str | None = None
    """A named shape from megatron_gspo.model.presets (tiny_dense, tiny_moe, qwen3_30b_a3b,
    qwen3_235b_a22b), randomly initialised from `seed`: for tests, benchmarks and the megatron
    rollout backend."""
    init_checkpoint: str | None = None
    """Megatron distributed checkpoint of the initial weights (tools/convert_hf_to_mcore.py output).
    None: convert hf_path at start-up. Ignored when resuming from checkpoint.dir."""
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """Parameter and activation dtype. Log-probs and the loss are always float32."""
    moe_aux_loss_coeff: float = 1e-3
    """Weight of Megatron's sequence-level load-balancing loss (MoE models only)."""

    def __post_init__(self):
        _check((self.hf_path is None) != (self.preset is None), "model.hf_path",
               "and model.preset: exactly one must be set", (self.hf_path, self.preset))
        _check(self.moe_aux_loss_coeff >= 0, "model.moe_aux_loss_coeff", "must be >= 0", self.moe_aux_loss_coeff)


@dataclass(frozen=True)
class ParallelConfig:
    """The parallel layout of the trainer's tp * pp * cp * dp processes."""

    tp: int = 1
    """Tensor parallel size."""
    pp: int = 1
    """Pipeline parallel size."""
    cp: int = 1
    """Context parallel size (Transformer Engine attention on GPUs; CPU attention in this package)."""
    ep: int = 1
    """Expert parallel size (MoE)."""
    dp: int = 1
    """Data parallel size: `megatron-gspo train` launches tp * pp * cp * dp trainer processes
    (expert parallelism reuses these ranks)."""
    etp: int | None = None
    """Expert tensor parallel size. None: tp when ep == 1 (experts sharded like the dense MLP; with
    ep == 1 Megatron treats expert weights as dense parameters, reduced over DP only, so experts
    replicated over TP ranks would miss the TP reduction), else 1 (gloo cannot do the uneven
    all-gathers that ep > 1 with etp > 1 needs: megatron/core/tensor_parallel/mappings.py:150)."""
    vpp: int | None = None
    """Virtual pipeline stages per rank (interleaved 1F1B), or None."""
    max_tokens_per_microbatch: int = 8192
    """Token budget of one micro-batch: rows x padded row length (padding costs compute, so it
    counts). A sequence longer than the budget gets a micro-batch of its own."""
    distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (Megatron's distributed optimizer)."""
    pack_sequences: bool = False
    """Several responses per micro-batch row, each attending only to itself (training/packing.py): less
    padding when response lengths vary. Needs the local attention spec (CPU; Transformer Engine's packed
    format, THD, is not wired here) and pp = 1. Works with gspo.routing_replay (each response's routing goes
    to its place in its row)."""

    def __post_init__(self):
        _positive("parallel", self, "tp", "pp", "cp", "ep", "dp", "max_tokens_per_microbatch")
        _check(not (self.pack_sequences and self.pp > 1), "parallel.pack_sequences",
               "needs pp = 1 (pipeline stages exchange activations of one fixed shape)", self.pack_sequences)
        if self.etp is not None:
            _positive("parallel", self, "etp")
        if self.vpp is not None:
            _check(self.vpp >= 2 and self.pp >= 2, "parallel.vpp", "needs vpp >= 2 and pp >= 2 (or None)", self.vpp)
        # Megatron's expert groups split each pipeline stage's tp * cp * dp ranks into etp x ep x expert-dp.
        expert_ranks, stage_ranks = self.ep * self.expert_tp, self.tp * self.cp * self.dp
        _check(stage_ranks % expert_ranks == 0, "parallel.ep",
               f"(times etp = {self.expert_tp}) must divide tp * cp * dp = {stage_ranks} (raise parallel.dp)",
               self.ep)

    @property
    def world_size(self) -> int:
        """Trainer processes: tp * pp * cp * dp."""
        return self.tp * self.pp * self.cp * self.dp

    @property
    def expert_tp(self) -> int:
        """etp with its default filled in (see etp)."""
        if self.etp is not None:
            return self.etp
        return self.tp if self.ep == 1 else 1

    def __str__(self) -> str:
        parts = [f"{k}{v}" for k, v in (("tp", self.tp), ("pp", self.pp), ("cp", self.cp), ("ep", self.ep),
                                        ("dp", self.dp)) if v > 1]
        return "x".join(parts) or "single"


@dataclass(frozen=True)
class GSPOConfig:
    algorithm: Literal["gspo", "gspo_token", "grpo"] = "gspo"
    """Policy loss: gspo (sequence ratio, GSPO eq. 5), gspo_token (eq. 13) or grpo (token ratio)."""
    eps_low: float | None = None
    """Lower clip range; None: the algorithm's default (GSPO 3e-4, GRPO 0.2; loss.policy.clip_range)."""
    eps_high: float | None = None
    """Upper clip range; None: the algorithm's default (GSPO 4e-4, GRPO 0.27; loss.policy.clip_range)."""
    num_minibatches: int = 4
    """Optimizer steps per rollout batch (the paper: 4). Mini-batch 1 is on-policy."""
    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    """Where pi_old's log-probs come from: recomputed by Megatron before the first mini-batch
    (mini-batch 1 then has s_i == 1 exactly), or the rollout engine's own."""
    recompute: Literal["auto", "fused", "per_minibatch"] = "auto"
    """How old_logprobs=recompute runs (training/old_logprobs.py): fused: mini-batch 1's pi_old is its own
    training forward (detached; s_i == 1 exactly) and mini-batches 2..K are recomputed in one forward-only
    pass, re-packed by parallel.max_tokens_per_microbatch (dense models only); per_minibatch: one
    forward-only pass per mini-batch on the micro-batches it trains on, recording an MoE model's routing
    per micro-batch; auto: fused for dense models, per_minibatch for MoE models. Only with
    old_logprobs=recompute."""
    group_size: int = 8
    """G: responses sampled per prompt."""
    prompts_per_step: int = 32
    """Prompts per rollout batch; the batch holds prompts_per_step * group_size responses."""
    advantage_std: Literal["sample", "population", "none"] = "sample"
    """Group advantage normaliser: sample std (/(G-1)), population std (/G), or none (r - mean)."""
    advantage_eps: float = 1e-6
    """Added to the group std before dividing."""
    dynamic_sampling: bool = False
    """Drop zero-signal groups (all rewards equal) and sample more prompts to refill the batch."""
    routing_replay: Literal["off", "old", "rollout"] = "off"
    """MoE Routing Replay (arXiv 2507.18071 section 4.3; MoE models only): off; old (R2: the routing
    recorded while recomputing pi_old's log-probs is replayed in every training forward of the
    mini-batch); rollout (R3: the rollout engine's routing, carried in each sample, is replayed in the
    recompute pass and the training forwards). The paper's GRPO baseline on MoE needs it; GSPO does not."""

    def __post_init__(self):
        for name in ("eps_low", "eps_high"):
            value = getattr(self, name)
            if value is not None:
                rule = (0 <= value < 1) if name == "eps_low" else value >= 0
                _check(rule, f"gspo.{name}", "must be in [0, 1)" if name == "eps_low" else "must be >= 0", value)
        _check(self.advantage_eps >= 0, "gspo.advantage_eps", "must be >= 0", self.advantage_eps)
        _positive("gspo", self, "num_minibatches", "group_size", "prompts_per_step")
        if self.advantage_std == "sample":
            _check(self.group_size >= 2, "gspo.group_size", "must be >= 2 with advantage_std=sample", self.group_size)
        _check(self.routing_replay != "old" or self.old_logprobs == "recompute", "gspo.routing_replay",
               "must not be old with gspo.old_logprobs=rollout (old replays the routing recorded while "
               "recomputing pi_old's log-probs)", self.routing_replay)
        _check(self.recompute == "auto" or self.old_logprobs == "recompute", "gspo.recompute",
               "applies to gspo.old_logprobs=recompute only (with rollout nothing is recomputed); leave it auto",
               self.recompute)
        responses = self.prompts_per_step * self.group_size
        _check(responses % self.num_minibatches == 0, "gspo.num_minibatches",
               f"must divide prompts_per_step * group_size = {responses}", self.num_minibatches)

    @property
    def responses_per_step(self) -> int:
        return self.prompts_per_step * self.group_size


@dataclass(frozen=True)
class RolloutConfig:
    backend: Literal["sglang", "megatron"] = "sglang"
    """sglang: SGLang servers; megatron: in-process generation by the trained model on every process (no
    server: colocated small runs)."""
    server_urls: tuple[str, ...] = ()
    """Running SGLang servers or router (http://host:port); empty: launch num_servers locally."""
    num_servers: int = 1
    """SGLang servers to launch when server_urls is empty."""
    concurrency: int = 64
    """Requests in flight per server."""
    parallel_sampling: Literal["n", "copies"] = "n"
    """How the G samples of a group are asked of SGLang, one request per group either way. n: the prompt
    once with sampling_params.n = G (SGLang prefills it in a warm-up round trip to its scheduler, then forks
    G samples from the cached prefix: tokenizer_manager.py:_handle_batch_request). copies: the prompt G times
    with n = 1 (SGLang hands the G copies to its scheduler in one message, no warm-up; each copy prefills its
    prompt unless the radix cache shares it). Copies win where prompts are short or the radix cache is off
    (the CPU demo: rollout 0.84x the time); n where long prompts share a prefill. Single-turn rollouts only
    (an episode's turns are one continuation each: rollout.turns_per_request)."""
    groups_per_request: int = 1
    """Groups sent together in one /generate request (SGLang's batch form: a list of prompts). 1: each group
    on its own, scored the moment it finishes and retried alone. More: fewer requests for SGLang's HTTP
    front end and tokenizer manager to handle (their per-request cost dominates short responses: the demo's
    16 groups x 16 samples of 4 tokens in one request took 0.83x the time of 16 requests), but a request's
    groups are scored only when all of them are done, and retried together. Single-turn rollouts only."""
    weight_sync: Literal["disk", "tensor", "broadcast"] = "disk"
    """How new weights reach the servers after each step: disk (rank 0 writes an HF checkpoint
    under run_dir/weights that the servers read; needs a file system they share), tensor (shared
    memory / CUDA IPC handles: servers on rank 0's host only) or broadcast (a gloo/NCCL group of
    trainer rank 0 and the servers)."""
    request_timeout_s: float = 600.0
    """Longest wait for one /generate answer (groups_per_request groups of G full responses): a stalled
    server fails the request, which is retried on another."""
    connect_timeout_s: float = 10.0
    """Longest wait to open a connection to a server."""
    max_attempts: int = 4
    """Tries per request over all servers before the rollout fails."""
    max_server_failures: int = 2
    """Consecutive failed requests after which a server is retired for the rest of a rollout call."""
    retry_backoff_s: float = 0.2
    """Pause before a failed request is sent again (doubles per attempt)."""
    api_key: str | None = None
    """The servers' API key: sent as `Authorization: Bearer ...` with every request (rollout.server_urls),
    and required by the servers this run launches (`--api-key`). None: no key."""
    server_args: tuple[str, ...] = ()
    """Further `sglang.launch_server` arguments for the servers this run launches (and `megatron-gspo
    serve`), verbatim, e.g. `rollout.server_args=[--mem-fraction-static,0.8]`."""
    server_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """The launched servers' weights/activations dtype (`--dtype`); None: model.dtype, the trainer's. bfloat16
    with a float32 trainer makes the train-inference mismatch a bf16 sampler brings (correction.*)."""
    max_total_tokens: int | None = None
    """KV-cache size of each launched server, in tokens (`--max-total-tokens`). None: SGLang's own on CUDA,
    16384 on CPU (where SGLang's own would take ~70% of the machine's memory)."""
    sleep_on_idle: bool = True
    """Launched servers run with `--sleep-on-idle`: with nothing to do, the scheduler waits on its request
    sockets instead of polling them in a busy loop. Without it an idle CPU server keeps a core at 50-100%
    (measured: two idle servers took ~1.5 of a 2-core machine), which the trainer needs between rollouts."""
    overlap_schedule: bool | None = None
    """SGLang's overlap scheduler (CPU-side batch preparation overlapped with the previous batch's forward)
    on launched servers; None: on with CUDA, off on CPU (`--disable-overlap-schedule`), where there is no
    device to overlap with (measured on the demo: rollout 0.85x, step 0.93x the time with it off)."""
    cpu_batched_attention: bool = True
    """CPU servers only: SGLang's torch_native attention runs as one batched SDPA per layer instead of one per
    request (the plugin platform/sglang_cpu_stubs/megatron_gspo_sglang_cpu.py): the demo's rollout call
    (16 prompts x 16) in 0.6x the time. False: SGLang's own per-request loop."""
    server_startup_timeout_s: float = 1800.0
    """How long a launched server (or `megatron-gspo serve`) may take to answer /health_generate; a server
    that exits during start-up is reported at once, whatever this is."""
    max_staleness: int = 0
    """Rollout batches generated ahead of training (rollout/manager.py): 0 = synchronous (generate, then
    train); 1 = one-step-off (the next batch is generated by the servers while the current one trains,
    with weights one version older); N: up to N batches ahead. Needs gspo.old_logprobs=rollout (pi_old is
    the behaviour policy, the sampler's own log-probs), or recompute with correction.weight on (pi_old is
    the proximal policy and the weights correct for the stale sampler), and rollout.backend=sglang (the
    in-process backend samples on the training ranks: nothing to overlap)."""
    partial_rollout: bool = False
    """With max_staleness > 0: a weight push does not wait for the batch being generated. The servers pause
    it (SGLang /pause_generation, mode retract), load the new weights and continue it under them, its KV
    recomputed (rollout/manager.py). A response that was cut keeps the tokens it had: the first
    `Sample.stale_prefix` tokens, by the older weights, condition the rest but are not trained (m_t = 0,
    GSPO.md); the tokens after them, by the new weights, train (SGLang's meta_info.weight_versions tells
    them apart). Long generations then never hold a push back; rollout/stale_prefix_fraction reports the
    share of response tokens not trained."""
    tools: tuple[str, ...] = ()
    """Python functions the model may call, as `package.module:function` (docs/agents.md): each one's JSON
    schema comes from its signature and docstring (transformers' get_json_schema), the chat template renders
    them into every prompt (`apply_chat_template(..., tools=...)`), the model's calls are parsed
    (rollout.tool_parser) and run in sandboxed worker processes (rollout.tool_workers, rollout.tool_timeout_s)
    and each result goes back as a `tool` message, up to rollout.max_turns model turns. Non-empty: every
    rollout is a multi-turn episode (the built-in tool episode, or rollout.episode_fn with these tools)."""
    episode_fn: str | None = None
    """A custom episode, `package.module:function`: `async def episode(ep) -> None` drives the model's turns
    (`await ep.generate()`), appends the environment's tokens (`ep.append(...)`), attaches rewards per turn
    (`ep.add_reward(x)`) and stores what the reward function needs (`ep.storage`): environments, games,
    user simulators (rollout/agent/episode.py, docs/agents.md). None: the tool episode when rollout.tools
    is set, else single-turn rollouts."""
    turns_per_request: int = 64
    """Episodes' model turns asked for at the same moment go together in one /generate request (SGLang's batch
    form, a list of contexts), at most this many; 1: one request per turn. A turn is short, so SGLang's
    per-request cost (HTTP front end, tokenizer manager) dominates it on CPU (the agent demo's rollout of 16
    prompts x 16 episodes is ~500 turns: one request each with 1)."""
    tool_parser: Literal["qwen3"] = "qwen3"
    """How tool calls are read from a model turn: qwen3 (Qwen3's and Hermes' format, one
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block per call; rollout/agent/tools.py)."""
    max_turns: int = 8
    """Most model turns of one episode; past it the episode ends (its last turn's tool calls are not run)."""
    tool_timeout_s: float = 10.0
    """Longest one tool call may take; past it its worker is killed and replaced and the model is told
    the call timed out (counted in rollout/tool_errors)."""
    tool_workers: int = 2
    """Worker processes running tool calls (the reward pool's kind: rewards/pool.py). Sandboxing is the
    point of them: tools never run in the trainer's process."""
    max_context_tokens: int | None = None
    """Longest prompt + episode, in tokens: a model turn gets at most what is left of it as max_new_tokens
    (and sampling.max_new_tokens at most); when nothing is left, or the environment's tokens would fill it,
    the episode ends with finish reason "length". None: the model's max_position_embeddings (SGLang's
    context length) less the 6 tokens SGLang keeps back (rollout/sglang/backend.py SGLANG_CONTEXT_RESERVE); more
    than that is refused at start. Episodes only (single-turn rollouts: sampling.max_new_tokens)."""

    def __post_init__(self):
        _positive("rollout", self, "num_servers", "concurrency", "groups_per_request", "max_attempts",
                  "max_server_failures", "max_turns", "tool_workers", "turns_per_request")
        _check(self.tool_timeout_s > 0, "rollout.tool_timeout_s", "must be > 0", self.tool_timeout_s)
        if self.max_context_tokens is not None:
            _positive("rollout", self, "max_context_tokens")
        _check(all(":" in spec for spec in self.tools), "rollout.tools", "must name functions as "
               "package.module:function", list(self.tools))
        _check(self.episode_fn is None or ":" in self.episode_fn, "rollout.episode_fn",
               "must name a function as package.module:function", self.episode_fn)
        if self.episodes:
            _check(self.backend == "sglang", "rollout.backend", "must be sglang with rollout.tools or "
                   "rollout.episode_fn (episodes are driven turn by turn over SGLang's HTTP API, token in / token "
                   "out; the in-process sampler generates whole batches collectively on every trainer rank)",
                   self.backend)
            _check(not self.partial_rollout, "rollout.partial_rollout", "is not supported with rollout.tools or "
                   "rollout.episode_fn (a weight push into an episode would change the policy between its turns; "
                   "overlapped rollouts without it are: every episode of a batch is sampled by one weight version)",
                   self.partial_rollout)
        for name in ("request_timeout_s", "connect_timeout_s", "server_startup_timeout_s"):
            _check(getattr(self, name) > 0, f"rollout.{name}", "must be > 0", getattr(self, name))
        _check(self.retry_backoff_s >= 0, "rollout.retry_backoff_s", "must be >= 0", self.retry_backoff_s)
        if self.max_total_tokens is not None:
            _positive("rollout", self, "max_total_tokens")
        _check(not self.partial_rollout or self.max_staleness > 0, "rollout.partial_rollout",
               "needs rollout.max_staleness > 0 (a synchronous run has no batch in flight when it pushes weights)",
               self.partial_rollout)
        _check(self.max_staleness >= 0, "rollout.max_staleness", "must be >= 0", self.max_staleness)
        _check(self.max_staleness == 0 or self.backend == "sglang", "rollout.max_staleness",
               "must be 0 with rollout.backend=megatron (the model samples on the ranks that train it: "
               "generation cannot overlap training)", self.max_staleness)
        if self.backend == "megatron":
            _check(not self.server_urls, "rollout.server_urls", "must be empty with backend=megatron",
                   self.server_urls)

    @property
    def episodes(self) -> bool:
        """Rollouts are multi-turn episodes (rollout.tools or rollout.episode_fn)."""
        return bool(self.tools) or self.episode_fn is not None


CorrectionMode = Literal["off", "token", "sequence", "geometric"]


@dataclass(frozen=True)
class CorrectionConfig:
    """Train-inference mismatch correction (loss/correction.py, docs/gspo.md): the sampler's log-probs mu
    are not pi_old's (bf16 vs fp32 kernels, batch-dependent reductions, an MoE routing differently). Off by
    default; every algorithm and Routing Replay compose with it. Needs gspo.old_logprobs=recompute (with
    rollout, pi_old is mu: every weight would be 1). The mismatch metrics (correction/kl_k3, ess, ...) are
    logged whenever both mu and a recomputed pi_old exist, on or off."""

    weight: CorrectionMode = "off"
    """Truncated importance weight (TIS) on each token's term, min(weight_cap, pi_old/mu): per token (token),
    one per sequence from the product of its token ratios (sequence) or from their geometric mean, length-
    normalised like GSPO's s_i (geometric). Stop-gradient."""
    weight_cap: float = 2.0
    """Upper bound of the weights (truncation)."""
    reject: CorrectionMode = "off"
    """Masked importance sampling (MIS; IcePop's two-sided token mask): tokens whose ratio pi_old/mu lies
    outside reject_band get m = 0 (token), or every token of a sequence whose product (sequence) or geometric
    mean (geometric) of ratios does. Rejected tokens count nowhere, as a stale prefix does."""
    reject_band: tuple[float, ...] = (0.5, 2.0)
    """[low, high] of the ratio kept by `reject`."""

    def __post_init__(self):
        _check(self.weight_cap > 0, "correction.weight_cap", "must be > 0", self.weight_cap)
        _check(len(self.reject_band) == 2 and 0 < self.reject_band[0] < self.reject_band[1], "correction.reject_band",
               "must be [low, high] with 0 < low < high", list(self.reject_band))

    @property
    def active(self) -> bool:
        return self.weight != "off" or self.reject != "off"


@dataclass(frozen=True)
class SamplingConfig:
    """How responses are sampled: the same object for the SGLang servers, the in-process Megatron
    sampler and `megatron-gspo rollout`."""

    temperature: float = 1.0
    """Softmax temperature; the training logits are divided by it too, or train and rollout disagree.
    Training needs > 0; 0 (greedy) serves offline rollouts from SGLang only."""
    top_p: float = 1.0
    """Nucleus sampling threshold in (0, 1]; tokens outside it get -inf log-probs in the rollout."""
    top_k: int = -1
    """Top-k sampling; -1 disables it."""
    max_new_tokens: int = 1024
    """Longest response sampled (finish_reason "length")."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a response besides the model's EOS ids (the stop token is part of it)."""
    stop: tuple[str, ...] = ()
    """Strings that end a response (SGLang only)."""

    def __post_init__(self):
        _check(self.temperature >= 0, "sampling.temperature", "must be >= 0", self.temperature)
        _check(0 < self.top_p <= 1, "sampling.top_p", "must be in (0, 1]", self.top_p)
        _check(self.top_k == -1 or self.top_k >= 1, "sampling.top_k", "must be -1 or >= 1", self.top_k)
        _positive("sampling", self, "max_new_tokens")


@dataclass(frozen=True)
class DataConfig:
    """The training prompts: files, keys, chat template, order (megatron_gspo/data/)."""

    train: tuple[str, ...] = ()
    """Prompt files: `.jsonl`, `.parquet`, a directory written by `datasets.Dataset.save_to_disk`, or a
    list of these (concatenated in order). Required to train."""
    prompt_key: str = "prompt"
    """Field holding the prompt: a string, or a list of {role, content} messages. Dotted keys reach
    nested fields (`extra.question`)."""
    answer_key: str = "answer"
    """Field holding the reference answer handed to the reward function (dotted keys too, e.g.
    `reward_model.ground_truth` as verl's DAPO-Math files store it)."""
    metadata_keys: tuple[str, ...] = ()
    """Other fields passed through to the reward function as `sample.metadata[key]` (dotted keys too)."""
    chat_template: Literal["auto", "true", "false"] = "auto"
    """auto: use the tokenizer's chat template when it has one and the prompt is messages (a string
    prompt then becomes one user message only with `true`); true: always (an error if the tokenizer
    has none); false: never (messages are an error, strings are tokenised as they are)."""
    system_prompt: str | None = None
    """A system message put before each prompt's messages (templated prompts only)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables for the template, e.g. {enable_thinking: false} for Qwen3."""
    max_prompt_tokens: int | None = None
    """Prompts longer than this (in tokens, after the template) are skipped and counted, never truncated."""
    shuffle: bool = True
    """Shuffle the prompts (seeded by `seed`), again every epoch."""
    epochs: int | None = None
    """Passes over the prompts; None: as many as num_steps needs. The run ends early, with a
    checkpoint, when they run out."""

    def __post_init__(self):
        if self.max_prompt_tokens is not None:
            _positive("data", self, "max_prompt_tokens")
        if self.epochs is not None:
            _positive("data", self, "epochs")
        _check(all(k for k in (self.prompt_key, self.answer_key, *self.metadata_keys)), "data.prompt_key",
               "answer_key and metadata_keys must be non-empty", (self.prompt_key, self.answer_key))


@dataclass(frozen=True)
class RewardConfig:
    """How responses are scored (megatron_gspo/rewards/)."""

    fn: str = "math"
    """math (Hugging Face math-verify: LaTeX, fractions, \\boxed{}, intervals, sets), exact_match (stripped
    strings equal), final_answer (the integer on the last "answer: N" line), none (0: with rollout.episode_fn,
    whose ep.add_reward gives every reward), or `package.module:function` taking a Sample (prompt,
    response_text, answer, metadata; of an episode also turns, tool_calls, storage) and returning a float (or
    raising megatron_gspo.rewards.Unparsed: scored 0, counted in reward/unparsed_fraction). In an episode
    this outcome reward attaches to the last model turn (docs/agents.md)."""
    workers: int = 2
    """Worker processes scoring in parallel (a hung or crashed one is killed and replaced). 0: score in the
    trainer's rollout thread, no process, no time limit: only for the built-ins known to finish quickly
    (exact_match, final_answer; refused before the run starts for math and user functions)."""
    timeout_s: float = 10.0
    """Longest a single sample may take to score; past it the sample scores 0 and counts as a timeout. The
    first 2 x max(workers, 1) samples of the run all failing (timeouts or errors) stops the run
    (rewards/pool.py)."""
    truncated: Literal["keep", "zero"] = "keep"
    """Responses cut by max_new_tokens (finish reason "length"): scored as they are, or 0."""

    def __post_init__(self):
        _check(self.workers >= 0, "reward.workers", "must be >= 0", self.workers)
        _check(self.timeout_s > 0, "reward.timeout_s", "must be > 0", self.timeout_s)
        _check(bool(self.fn), "reward.fn", "must be set", self.fn)


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation during training (and `megatron-gspo eval`)."""

    datasets: dict[str, str] = field(default_factory=dict)
    """name -> dataset path (formats and keys as in `data`); `eval.datasets.NAME=PATH` on the command line."""
    interval: int = 0
    """Evaluate every this many rollout steps, at step 0 and at the end; 0: off."""
    samples_per_prompt: int = 1
    """k: responses per prompt (mean@k = average pass@1 over them, as the GSPO paper reports AIME'24)."""
    temperature: float = 1.0
    """Sampling temperature of eval responses (0: greedy, SGLang only)."""
    top_p: float = 1.0
    """Nucleus threshold of eval responses."""
    max_new_tokens: int | None = None
    """Longest eval response; None: sampling.max_new_tokens."""
    max_prompts: int | None = None
    """Evaluate only the first this-many prompts of each dataset; None: all."""

    def __post_init__(self):
        _check(self.interval >= 0, "eval.interval", "must be >= 0", self.interval)
        _positive("eval", self, "samples_per_prompt")
        _check(self.temperature >= 0, "eval.temperature", "must be >= 0", self.temperature)
        _check(0 < self.top_p <= 1, "eval.top_p", "must be in (0, 1]", self.top_p)
        for name in ("max_new_tokens", "max_prompts"):
            if getattr(self, name) is not None:
                _positive("eval", self, name)
        for name, path in self.datasets.items():
            _check(isinstance(path, str) and bool(path), f"eval.datasets.{name}", "must be a dataset path", path)
        _check(not (self.interval and not self.datasets), "eval.interval", "needs eval.datasets", self.interval)


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 1e-6
    """Peak learning rate (Adam)."""
    min_lr: float = 0.0
    """Final learning rate of the linear/cosine schedules."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate decay after warm-up, over all optimizer steps (num_steps * num_minibatches)."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW)."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables it."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""

    def __post_init__(self):
        _check(self.lr > 0, "optimizer.lr", "must be > 0", self.lr)
        _check(0 <= self.min_lr <= self.lr, "optimizer.min_lr", "must be in [0, lr]", self.min_lr)
        _check(self.warmup_steps >= 0, "optimizer.warmup_steps", "must be >= 0", self.warmup_steps)
        _check(self.weight_decay >= 0, "optimizer.weight_decay", "must be >= 0", self.weight_decay)
        _check(self.clip_grad >= 0, "optimizer.clip_grad", "must be >= 0", self.clip_grad)
        for name in ("adam_beta1", "adam_beta2"):
            _check(0 <= getattr(self, name) < 1, f"optimizer.{name}", "must be in [0, 1)", getattr(self, name))
        _check(self.adam_eps > 0, "optimizer.adam_eps", "must be > 0", self.adam_eps)


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str | None = None
    """Checkpoint directory (iter_XXXXXXX/ folders and latest_checkpointed_iteration.txt); None: no
    checkpoints."""
    interval: int = 50
    """Save every this many rollout steps (and at the end)."""
    keep_last: int = 3
    """Complete checkpoints kept; older ones are deleted. 0 keeps all."""
    resume: bool = True
    """Continue from the latest complete checkpoint in dir when there is one."""
    save_on_signal: bool = True
    """Write a checkpoint when SIGTERM/SIGINT arrives (e.g. Slurm preemption) before exiting."""
    async_save: bool = False
    """Write checkpoints in the background (Megatron-Core's async save): the step waits only for the
    small files and the planning; a forked process writes the tensors from a copy-on-write snapshot
    (memory: up to one more copy of the pages training changes meanwhile), and the checkpoint becomes
    the latest once every rank has written it (checked each step, one small all-reduce). The run's end, a
    stop signal and a failure of rank 0's rollout, reward function or weight push (raised on every rank)
    wait for it and publish it; a crash of one rank or a kill before then resumes from the previous
    checkpoint, unless the save was complete (verified at the next start, then published; else removed).
    Tested on CPU (gloo); on GPU Megatron first copies the tensors to host memory, a path not yet run
    here."""
    export_hf: str | None = None
    """When the run completes, the final checkpoint converted to a Hugging Face model in this directory
    (the checkpoint tools' mcore->hf conversion; config and tokenizer files from model.hf_path). An
    existing export there is replaced only once the new one is complete. Needs dir and model.hf_path."""

    def __post_init__(self):
        _positive("checkpoint", self, "interval")
        _check(self.keep_last >= 0, "checkpoint.keep_last", "must be >= 0", self.keep_last)


@dataclass(frozen=True)
class LoggingConfig:
    run_dir: str = "runs/gspo"
    """Run directory: metrics.jsonl, the resolved config, TensorBoard events, plots."""
    tensorboard: bool = True
    """Write TensorBoard events to run_dir/tensorboard (skipped with a warning if not installed)."""
    wandb_project: str | None = None
    """Weights & Biases project; None: no W&B."""
    wandb_offline: bool = False
    """Log W&B offline (sync later with `wandb sync`)."""
    progress_bar: bool = True
    """Show a progress bar on rank 0."""
    profile: bool = False
    """Time each rollout step's named parts on every rank (megatron_gspo/profiling.py) and log them as
    profile/PART/rank0_s and profile/PART/others_max_s (benchmarks/step.py --profile prints the table).
    Costs one gather per step and a timer around each torch.distributed collective."""
    save_rollouts: bool | int = False
    """Write each rollout step's trained samples to run_dir/rollouts/step_NNNNNN.jsonl (rollout/jsonl.py
    write_rollouts: prompt, trajectory text, response_ids, loss_mask, the sampler's log-probs, turns with their
    rewards, tool calls and errors, reward and advantage): true every step, N every N steps, false off."""

    def __post_init__(self):
        _check(self.save_rollouts >= 0, "logging.save_rollouts", "must be true, false or a number of steps >= 1",
               self.save_rollouts)

    @property
    def save_rollouts_every(self) -> int:
        """Rollout steps between saved rollouts; 0: never."""
        return int(self.save_rollouts)


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig
    """The policy model (required: model.hf_path or model.preset)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout and micro-batch size."""
    gspo: GSPOConfig = field(default_factory=GSPOConfig)
    """The algorithm."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Where rollouts come from (backend, servers, weight sync)."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """How responses are sampled."""
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    """Train-inference mismatch correction (importance weights, rejection)."""
    data: DataConfig = field(default_factory=DataConfig)
    """The training prompts."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """How responses are scored."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Adam and its learning-rate schedule."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing and resume."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics and logs."""
    seed: int = 1234
    """Seed of model initialisation, data order and sampling."""
    num_steps: int = 100
    """Rollout steps; each makes gspo.num_minibatches optimizer steps."""

    def __post_init__(self):
        _check(self.num_steps >= 1, "num_steps", "must be >= 1", self.num_steps)
        # the loss divides the training logits by it: a policy's log-probs need a temperature
        _check(self.sampling.temperature > 0, "sampling.temperature", "must be > 0 to train", self.sampling.temperature)
        if self.rollout.backend == "sglang":
            _check(self.model.hf_path is not None, "model.hf_path",
                   "is required with rollout.backend=sglang (SGLang serves Hugging Face weights)", None)
        _check(self.rollout.max_staleness == 0 or self.gspo.old_logprobs == "rollout" or self.correction.weight != "off",
               "rollout.max_staleness", "> 0 needs gspo.old_logprobs=rollout (pi_old is the behaviour policy, the "
               "sampler's own log-probs; GSPO's sequence ratio tolerates them: arXiv 2507.18071 section 4.3), or "
               "gspo.old_logprobs=recompute with correction.weight on (pi_old is the weights at the start of the step, "
               "the proximal policy, and the truncated weight corrects for the stale sampler: AReaL's decoupled "
               "objective)", self.rollout.max_staleness)
        _check(not self.correction.active or self.gspo.old_logprobs == "recompute", "correction.weight",
               "and correction.reject need gspo.old_logprobs=recompute (with rollout, pi_old is the sampler's mu "
               "and every ratio is 1)", (self.correction.weight, self.correction.reject))
        _check(not (self.rollout.episodes and self.gspo.routing_replay == "rollout"), "gspo.routing_replay",
               "must not be rollout with rollout.tools or rollout.episode_fn (an episode's routing would be stitched "
               "from one request per turn, untested: SGLang on CPU cannot serve MoE); old (R2) works",
               self.gspo.routing_replay)
        _check(self.reward.fn != "none" or self.rollout.episode_fn is not None, "reward.fn",
               "may be none only with rollout.episode_fn (whose ep.add_reward gives the rewards)", self.reward.fn)
        _check(not (self.rollout.partial_rollout and self.gspo.routing_replay == "rollout"), "rollout.partial_rollout",
               "is not yet supported with gspo.routing_replay=rollout (the routing SGLang reports for a response "
               "continued under new weights is untested); set one of them off", self.rollout.partial_rollout)

        if self.checkpoint.export_hf is not None:
            _check(self.checkpoint.dir is not None, "checkpoint.export_hf",
                   "needs checkpoint.dir (the export converts the final checkpoint)", self.checkpoint.export_hf)
            _check(self.model.hf_path is not None, "checkpoint.export_hf",
                   "needs model.hf_path (its config and tokenizer files go with the export)", self.checkpoint.export_hf)

    @property
    def optimizer_steps(self) -> int:
        return self.num_steps * self.gspo.num_minibatches


# ---- loading -------------------------------------------------------------------------------------

def read_yaml(path: str | Path) -> Any:
    """The YAML file's contents. A syntax error is a one-line ValueError naming the file, line and column;
    so is a key given twice in one mapping (at any depth), which PyYAML would resolve silently to the
    last value: the error names the key and both lines."""
    with open(path) as f:
        text = f.read()
    try:
        _refuse_duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader), path)
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark else str(path)
        context = ""
        if e.context and e.context_mark and e.problem_mark:
            context = f" ({e.context} at line {e.context_mark.line + 1}, column {e.context_mark.column + 1})"
        raise ValueError(f"{where}: invalid YAML: {e.problem or e.context}{context}") from None
    except yaml.reader.ReaderError as e:  # a character YAML does not allow (control characters)
        line = text.count("\n", 0, e.position) + 1
        column = e.position - text.rfind("\n", 0, e.position)
        raise ValueError(f"{path}, line {line}, column {column}: invalid YAML: character {chr(e.character)!r} "
                         "is not allowed") from None


def _refuse_duplicate_keys(root, path) -> None:
    """ValueError for the first mapping (of the composed YAML document `root`) that has a key twice."""
    stack, walked = [(root, "")], set()
    while stack:
        node, prefix = stack.pop()
        if node is None or id(node) in walked:  # an empty document, or an alias of a node walked already
            continue
        walked.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack += [(item, f"{prefix}[{i}]") for i, item in enumerate(node.value)]
        elif isinstance(node, yaml.MappingNode):
            lines: dict[tuple, int] = {}
            for key, value in node.value:
                if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                    continue
                name = f"{prefix}.{key.value}" if prefix else key.value
                line = key.start_mark.line + 1
                if (key.tag, key.value) in lines:
                    raise ValueError(f"{path}: key {name!r} is given twice, at line {lines[key.tag, key.value]} "
                                     f"and at line {line} (remove one)")
                lines[key.tag, key.value] = line
                stack.append((value, name))


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> TrainConfig:
    """TrainConfig from a YAML file (or the defaults) with `key.sub=value` overrides applied."""
    raw: dict = {}
    if path is not None:
        raw = read_yaml(path) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} must look like key.sub=value")
        key = key.strip()
        *parents, leaf = key.split(".")
        cls, node, prefix = TrainConfig, raw, ""
        for i, part in enumerate(parents):
            tp = _field_type(cls, part, prefix)
            if typing.get_origin(tp) is dict:  # `eval.datasets.NAME=PATH`: one entry of a mapping
                entry = ".".join([*parents[i + 1:], leaf])
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise ValueError(f"{prefix}{part} must be a mapping")
                value_tp = typing.get_args(tp)[1]
                node[entry] = text.strip() if value_tp is str else yaml.safe_load(text)
                break
            if not dataclasses.is_dataclass(tp):
                raise ValueError(f"{prefix}{part} is a value, not a section: cannot set {key}")
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"{prefix}{part} must be a mapping")
            cls, prefix = tp, f"{prefix}{part}."
        else:
            _set_leaf(node, cls, leaf, prefix, key, text)
    return from_dict(TrainConfig, raw)


def _set_leaf(node: dict, cls, leaf: str, prefix: str, key: str, text: str) -> None:
    tp = _field_type(cls, leaf, prefix)
    if dataclasses.is_dataclass(tp):
        raise ValueError(f"{key} is a section; set one of its fields, e.g. {key}.{dataclasses.fields(tp)[0].name}=...")
    node[leaf] = _parse_text(text.strip(), tp, key)


def from_dict(cls, data: dict, prefix: str = ""):
    """Build dataclass `cls` from a nested mapping, coercing each value to its field's type."""
    if not isinstance(data, dict):
        raise ValueError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        tp = _field_type(cls, key, prefix)
        kwargs[key] = _coerce(value, tp, f"{prefix}{key}") if not dataclasses.is_dataclass(tp) \
            else from_dict(hints[key], value or {}, f"{prefix}{key}.")
    for f in dataclasses.fields(cls):
        if f.name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            if dataclasses.is_dataclass(hints[f.name]):
                kwargs[f.name] = from_dict(hints[f.name], {}, f"{prefix}{f.name}.")
            else:
                raise ValueError(f"{prefix}{f.name} is required")
    return cls(**kwargs)


def to_dict(config) -> dict:
    """Plain nested dict (tuples as lists), for YAML dumps and metrics headers."""
    def plain(v):
        return list(v) if isinstance(v, tuple) else dict(v) if isinstance(v, dict) else v
    return {k: (to_dict(v) if dataclasses.is_dataclass(v) else plain(v))
            for k, v in ((f.name, getattr(config, f.name)) for f in dataclasses.fields(config))}


def dump_yaml(config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(config), sort_keys=False))


def _leaf_paths(cls, prefix: str = "") -> list[str]:
    out = []
    for name, tp in typing.get_type_hints(cls).items():
        out += _leaf_paths(tp, f"{prefix}{name}.") if dataclasses.is_dataclass(tp) else [f"{prefix}{name}"]
    return out


def _field_type(cls, key: str, prefix: str):
    """The type of field `key` of `cls`, or a ValueError suggesting the nearest valid key."""
    hints = typing.get_type_hints(cls)
    if key in hints:
        return hints[key]
    raise ValueError(f"unknown config key {prefix + key!r}{_suggestion(key, prefix, hints)}")


def _suggestion(key: str, prefix: str, hints: dict) -> str:
    """The closest valid key: a typo in this section, or the name of a field in another section (e.g.
    `eps_low` -> `gspo.eps_low`, `rollout.max_new_tokens` -> `sampling.max_new_tokens`), whichever is closer."""
    def closeness(name: str) -> float:
        return difflib.SequenceMatcher(None, key, name).ratio()
    here = max(hints, key=closeness)
    by_leaf = {p.rsplit(".", 1)[-1]: p for p in reversed(_leaf_paths(TrainConfig))
               if not (prefix and p.startswith(prefix))}
    elsewhere = max(by_leaf, key=closeness, default=None)
    if elsewhere is not None and closeness(elsewhere) >= 0.75 and closeness(elsewhere) > closeness(here):
        return f"; did you mean {by_leaf[elsewhere]!r}?"
    if closeness(here) >= 0.6:
        return f"; did you mean {prefix + here!r}?"
    return f"; valid keys: {', '.join(hints)}"


_TRUE, _FALSE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}
_TUPLE_ITEMS = {str: "strings", int: "integers", float: "numbers"}


def _optional_inner(tp):
    """(inner type, True) for `X | None`, else (tp, False)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _bool_or_int(tp) -> bool:
    """The field type `bool | int` (a switch that may also be a count, e.g. logging.save_rollouts)."""
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and set(typing.get_args(tp)) == {bool, int}


def _parse_text(text: str, tp, name: str):
    """A command-line string parsed by the field's type."""
    inner, optional = _optional_inner(tp)
    if optional and text.lower() in ("none", "null", "~", ""):
        return None
    if _bool_or_int(inner):
        if text.lstrip("-").isdigit():
            return int(text)
        if text.lower() in _TRUE | _FALSE:
            return text.lower() in _TRUE
        raise ValueError(f"{name} must be true, false or an integer, got {text!r}")
    if typing.get_origin(inner) is dict:
        try:
            return yaml.safe_load(text)  # `{enable_thinking: false}`
        except yaml.YAMLError as e:
            raise ValueError(f"{name} must be a mapping like {{key: value}}, got {text!r}") from e
    if typing.get_origin(inner) is tuple:
        text = text.strip("[]()")
        return _coerce(tuple(s.strip() for s in text.split(",") if s.strip()), tp, name)
    if inner is bool:
        if text.lower() in _TRUE | _FALSE:
            return text.lower() in _TRUE
        raise ValueError(f"{name} must be true or false, got {text!r}")
    if inner in (int, float):
        try:
            return inner(text)
        except ValueError:
            raise ValueError(f"{name} must be {'an integer' if inner is int else 'a number'}, got {text!r}") from None
    return text  # str and Literal: checked by _coerce


def _coerce(value, tp, name: str):
    """A YAML (or parsed) value checked and converted to the field's type."""
    inner, optional = _optional_inner(tp)
    if value is None:
        if optional:
            return None
        raise ValueError(f"{name} must not be empty")
    if isinstance(value, str) and inner is not str and typing.get_origin(inner) not in (Literal, dict):
        value = _parse_text(value, tp, name)  # e.g. YAML reads `3e-4` as a string
        if value is None:
            return None
    if _bool_or_int(inner):
        if not isinstance(value, int):  # bool is an int
            raise ValueError(f"{name} must be true, false or an integer, got {value!r}")
        return value
    if typing.get_origin(inner) is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ValueError(f"{name} must be a mapping with string keys, got {value!r}")
        item = typing.get_args(inner)[1]
        return {k: v if item is Any else _coerce(v, item, f"{name}.{k}") for k, v in value.items()}
    if typing.get_origin(inner) is Literal:
        choices = typing.get_args(inner)
        if isinstance(value, bool) and "true" in choices:  # YAML reads `true` as a bool
            value = str(value).lower()
        elif value is False and "off" in choices:  # ... and `off` as False (YAML 1.1)
            value = "off"
        if value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}")
        return value
    if typing.get_origin(inner) is tuple:
        item = typing.get_args(inner)[0]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{name} must be a list of {_TUPLE_ITEMS[item]}, got {value!r}")
        if item in (int, float):
            try:
                return tuple(item(v) if isinstance(v, str) else _coerce(v, item, name) for v in value)
            except ValueError:
                raise ValueError(f"{name} must be a list of {_TUPLE_ITEMS[item]}, got {value!r}") from None
        if not all(isinstance(v, str) for v in value):
            raise ValueError(f"{name} must be a list of strings, got {value!r}")
        return tuple(value)
    if inner is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
        return value
    if inner is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        return value
    if inner is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name} must be a number, got {value!r}")
        return float(value)
    if inner is str:
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {value!r}")
        return value
    raise TypeError(f"{name}: unsupported field type {tp}")
