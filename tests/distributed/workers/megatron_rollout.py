"""The in-process Megatron sampler under one parallel layout (one launch runs every check).

usage: torchrun --nproc-per-node N megatron_rollout.py WORKDIR NAME [tp=N] [pp=N] [cp=N] [ep=N]
(1 where absent; dp takes the other ranks: trainer_common.worker_args)

WORKDIR/hf holds a tiny Qwen3-MoE (tests/tiny_hf.py, 4 experts top-2, vocab 300 padded to 384 or
512). NAME "reference" (one process) converts it into WORKDIR/mcore first. Every layout loads
WORKDIR/mcore, samples 5 prompts x 3 with (A) plain temperature sampling, (B) top-k 20 + top-p 0.9,
(C) A's settings with a stop token taken from A's samples, checks what it can on its own and writes
WORKDIR/NAME.json for the test to compare with the reference:
- every rank holds the same samples (all of them, whatever the data-parallel split);
- C is A cut right after the first stop token (finish "stop"), or A unchanged (finish "length");
- reference only: each rollout log-prob equals a float64 log_softmax of the model's own logits of the
  full sequence (within 1e-5), and every B token is among the 20 most likely of those logits.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_gspo.config import GSPOConfig, ModelConfig, RolloutConfig, SamplingConfig, TrainConfig
from megatron_gspo.convert.hf_to_mcore import convert_hf_to_mcore
from megatron_gspo.convert.load import load_weights
from megatron_gspo.parallel.groups import init_megatron
from megatron_gspo.rollout.megatron.generator import MegatronGenerator
from megatron_gspo.training.setup import build_policy
from megatron_gspo.samples import Prompt

from checks import check, done
from trainer_common import worker_args

TEMPERATURE, VOCAB, N = 0.8, 300, 3


def prompts() -> list[Prompt]:
    g = torch.Generator().manual_seed(11)
    return [Prompt(group_id=10 + i, prompt_ids=torch.randint(1, VOCAB, (2 + i,), generator=g).tolist())
            for i in range(5)]


def as_plain(groups) -> list:
    return [[[s.response_ids, s.rollout_logprobs, s.finish_reason, s.weight_version] for s in group]
            for group in groups]


def check_stop_cut(a: list, c: list, stop: int) -> None:
    for group_a, group_c in zip(a, c):
        for (ids_a, lp_a, _, _), (ids_c, lp_c, finish_c, _) in zip(group_a, group_c):
            if stop in ids_a:
                cut = ids_a.index(stop) + 1
                assert ids_c == ids_a[:cut] and finish_c == "stop", (ids_a, ids_c, finish_c)
            else:
                assert ids_c == ids_a and finish_c == "length", (ids_a, ids_c, finish_c)
            assert max(abs(x - y) for x, y in zip(lp_c, lp_a)) < 1e-5


def check_against_full_logits(model, groups, top_k: int | None = None) -> float:
    """Largest |rollout log-prob - float64 log_softmax(logits / T)| over all sampled tokens."""
    worst = 0.0
    for group in groups:
        for s in group:
            tokens = torch.tensor([s.prompt_ids + s.response_ids])
            logits = model(tokens, torch.arange(tokens.shape[1])[None], None)[0, :, :VOCAB].double()
            logp = torch.log_softmax(logits / TEMPERATURE, -1)
            P = len(s.prompt_ids)
            for t, (token, lp) in enumerate(zip(s.response_ids, s.rollout_logprobs)):
                worst = max(worst, abs(logp[P - 1 + t, token].item() - lp))
                if top_k is not None:
                    assert token in logp[P - 1 + t].topk(top_k).indices.tolist(), (t, token)
    return worst


def main() -> None:
    workdir, name = Path(sys.argv[1]), sys.argv[2]
    layout, _ = worker_args(sys.argv[3:])
    config = TrainConfig(model=ModelConfig(hf_path=str(workdir / "hf"), dtype="float32"), parallel=layout,
                         gspo=GSPOConfig(group_size=N, prompts_per_step=5, num_minibatches=1),
                         rollout=RolloutConfig(backend="megatron"), seed=99, num_steps=1)
    pgs = init_megatron(config.parallel, seed=config.seed)
    rank = dist.get_rank()
    if name == "reference" and rank == 0:
        convert_hf_to_mcore(workdir / "hf", workdir / "mcore", progress=False)
    dist.barrier()
    policy = build_policy(config, pgs)
    load_weights(policy.model, workdir / "mcore")

    def run(**kw):
        sampling = SamplingConfig(temperature=TEMPERATURE, max_new_tokens=6, **kw)
        generator = MegatronGenerator(policy.model, sampling, vocab_size=VOCAB, seed=config.seed,
                                      max_tokens_per_microbatch=64, pgs=pgs)
        groups, stats = generator.generate(prompts(), n=N, weight_version="7")
        return groups, stats

    a, stats = run()
    b, _ = run(top_k=20, top_p=0.9)
    stop = a[0][0].response_ids[2]
    c, _ = run(stop_token_ids=(stop,))
    result = {"a": as_plain(a), "b": as_plain(b), "c": as_plain(c), "stop": stop,
              "tokens_per_s": stats.tokens_per_s}
    with check("N samples per prompt, indexed 0..N-1"):
        assert all(len(g) == N and [s.sample_index for s in g] == list(range(N)) for g in a)
    with check("every sample has the weight version and max_new_tokens tokens"):
        assert all(s.weight_version == "7" and len(s.response_ids) == 6 for g in a for s in g)
    with check("a stop token cuts the samples right after it"):
        check_stop_cut(result["a"], result["c"], stop)
        assert any(r[2] == "stop" for g in result["c"] for r in g), "the stop token ended no response"
    with check("every rank holds the same samples"):
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, {k: result[k] for k in ("a", "b", "c")})
        assert all(other == everyone[0] for other in everyone), "ranks disagree on the samples"
    if name == "reference":
        with check("rollout log-probs are the model's (float64 log_softmax), top-k respected"):
            model = policy.model[0].module
            result["max_abs_logprob_error"] = max(check_against_full_logits(model, a),
                                                  check_against_full_logits(model, b, top_k=20))
            assert result["max_abs_logprob_error"] < 1e-5, result["max_abs_logprob_error"]
    if rank == 0:
        (workdir / f"{name}.json").write_text(json.dumps(result))
    print(f"{name} rank {rank} {stats.tokens_per_s:.0f} tokens/s", flush=True)
    done()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
