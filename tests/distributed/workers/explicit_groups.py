"""A train step, compute_logprobs and MegatronGenerator.generate with Megatron's global process-group
getters made to raise: every process group comes from init_megatron's collection (`pgs`).

usage: torchrun --nproc-per-node 2 explicit_groups.py [tp=N] [pp=N] [cp=N] [ep=N] [model=dense|moe]
(1 and dense where absent; dp takes the other ranks: trainer_common.worker_args)

As Megatron-Core's tests of `tensor_parallel/cross_entropy.py` do, the getters of
`megatron.core.parallel_state` are replaced by functions that raise once the model, its optimizer
and the generator are built (start-up may read the globals: init_megatron builds the collection from
them, and the optimizer is built by Megatron from them). Every module that imported a getter by name
(`from megatron.core.parallel_state import get_..._group`) is patched too. Each check then runs the
same call on an identical model built before the patch and must give the same numbers, so the
explicit groups are the same groups, not just any groups.

What honestly stays global in megatron-core 0.16.1 is listed in MEGATRON_GLOBALS, each with the
upstream line that reads it; those reads (and only from there) keep working. Each check is a named check of
workers/checks.py: a failure names it.
"""
from __future__ import annotations

import sys
import types

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_gspo.config import SamplingConfig
from megatron_gspo.model.presets import PRESETS
from megatron_gspo.parallel.groups import init_megatron
from megatron_gspo.rollout.megatron.generator import MegatronGenerator
from megatron_gspo.training.forward_step import LossSettings
from megatron_gspo.training.step import compute_logprobs, train_on_batch
from megatron_gspo.samples import Prompt

from checks import check, done
from trainer_common import RECOMPUTE, steps, synthetic_responses, tiny_model, worker_args


def _anywhere(caller) -> bool:
    return True


def _unused_tp_group_of_row_parallel_linear(caller) -> bool:
    """megatron-core 0.16.1 tensor_parallel/layers.py:1281: RowParallelLinear.forward passes tp_group=None
    to linear_with_grad_accumulation_and_async_allreduce, which resolves it (layers.py:713 ->
    utils.py:512) to the global TP group and uses it only for allreduce_dgrad or sequence_parallel,
    both passed as False by that call: the global group is fetched, never communicated on."""
    user = caller.f_back
    return (caller.f_code.co_name == "get_tensor_model_parallel_group_if_none"
            and user.f_code.co_name == "linear_with_grad_accumulation_and_async_allreduce"
            and not user.f_locals["allreduce_dgrad"] and not user.f_locals["sequence_parallel"])


# What megatron-core 0.16.1 itself still reads from parallel_state at step time though every
# component got the pg_collection: getter -> (when the read is allowed, given its caller's frame).
MEGATRON_GLOBALS = {
    # utils.py:496, get_tensor_model_parallel_group_if_none: asks whether the globals are set up
    # before it returns the group it was *given* (every TP/EP collective goes through it); no group read.
    "is_initialized": _anywhere,
    # tensor_parallel/layers.py:482 and :519: the scratch buffer of the sequence-parallel all-gather
    # (MoE with TP): memory, not a process group.
    "get_global_memory_buffer": _anywhere,
    "get_tensor_model_parallel_group": _unused_tp_group_of_row_parallel_linear,
}


class GlobalGroupRead(RuntimeError):
    pass


def forbid_global_getters() -> list[str]:
    """Make every parallel_state getter (get_* / is_*) raise, wherever it was imported; return their names."""
    originals = {name: fn for name, fn in vars(parallel_state).items()
                 if callable(fn) and name.startswith(("get_", "is_"))
                 and getattr(fn, "__module__", None) == parallel_state.__name__}

    def raiser(name):
        allowed = MEGATRON_GLOBALS.get(name)

        def forbidden(*args, **kwargs):
            if allowed is not None and allowed(sys._getframe(1)):
                return originals[name](*args, **kwargs)
            caller = sys._getframe(1)
            raise GlobalGroupRead(f"megatron.core.parallel_state.{name} was called from "
                                  f"{caller.f_code.co_filename}:{caller.f_lineno}: process groups must "
                                  "come from the pgs collection")
        return forbidden

    replacements = {fn: raiser(name) for name, fn in originals.items()}
    for module in list(sys.modules.values()):
        if not isinstance(module, types.ModuleType) or not module.__name__.startswith("megatron"):
            continue
        for attr, value in list(vars(module).items()):
            try:
                if value in replacements:
                    setattr(module, attr, replacements[value])
            except TypeError:  # unhashable module attribute
                continue
    return sorted(originals)


def prompts(vocab: int) -> list[Prompt]:
    g = torch.Generator().manual_seed(7)
    return [Prompt(group_id=i, prompt_ids=torch.randint(1, vocab, (3 + i,), generator=g).tolist())
            for i in range(4)]


def say(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def main() -> None:
    layout, options = worker_args(sys.argv[1:], model="dense")
    preset = {"dense": "tiny_dense", "moe": "tiny_moe"}[options.model]
    shape = PRESETS[preset]
    pgs = init_megatron(layout, seed=1)
    loss = LossSettings(algorithm="gspo", temperature=1.0, vocab_size=shape.vocab_size)
    settings = steps(loss, num_minibatches=2, max_tokens_per_microbatch=64)
    responses = synthetic_responses(seed=3, n=16)
    generation = SamplingConfig(temperature=1.0, top_k=20, max_new_tokens=4)

    # Two identical models (same seed); the reference runs while the globals still work.
    reference, ref_optimizer, ref_scheduler = tiny_model(layout, pgs=pgs, seed=5, preset=preset)
    model, optimizer, scheduler = tiny_model(layout, pgs=pgs, seed=5, preset=preset)
    ref_generator = MegatronGenerator(reference, generation, vocab_size=shape.vocab_size, seed=11,
                                      max_tokens_per_microbatch=64, pgs=pgs)
    generator = MegatronGenerator(model, generation, vocab_size=shape.vocab_size, seed=11,
                                  max_tokens_per_microbatch=64, pgs=pgs)
    expected_records = train_on_batch(reference, ref_optimizer, responses, settings, RECOMPUTE, pgs=pgs,
                                      scheduler=ref_scheduler)
    expected_logprobs = compute_logprobs(reference, responses, loss, pgs=pgs, max_tokens_per_microbatch=8192)
    expected_groups, _ = ref_generator.generate(prompts(shape.vocab_size), n=2, weight_version="1")

    forbidden = forbid_global_getters()
    say(f"{len(forbidden)} parallel_state getters raise from here on")
    with check("getters forbidden"):
        try:
            parallel_state.get_tensor_model_parallel_group()
        except GlobalGroupRead:
            pass
        else:
            raise AssertionError("parallel_state.get_tensor_model_parallel_group still works")

    with check("train step"):
        records = train_on_batch(model, optimizer, responses, settings, RECOMPUTE, pgs=pgs, scheduler=scheduler)
        assert len(records) == 2, f"{len(records)} records"
        assert records[0]["loss/ratio_min"] == records[0]["loss/ratio_max"] == 1.0, records[0]
        for got, want in zip(records, expected_records):
            for key in ("loss/value", "train/grad_norm", "loss/ratio_min", "loss/ratio_max", "train/entropy", "loss/clipped_fraction_seq"):
                assert got[key] == want[key], f"{key} {got[key]!r} vs {want[key]!r} with global groups"
    say(f"train step: loss {records[0]['loss/value']:.6f} {records[1]['loss/value']:.6f}, "
        f"grad norm {records[0]['train/grad_norm']:.6f}, as with the global groups")

    with check("compute_logprobs"):
        logprobs = compute_logprobs(model, responses, loss, pgs=pgs, max_tokens_per_microbatch=8192)
        assert logprobs == expected_logprobs, "log-probs differ from the global-groups run"

    with check("generate"):
        groups, _ = generator.generate(prompts(shape.vocab_size), n=2, weight_version="1")
        got = [[(s.response_ids, s.rollout_logprobs) for s in g] for g in groups]
        want = [[(s.response_ids, s.rollout_logprobs) for s in g] for g in expected_groups]
        assert got == want, f"{got} vs {want}"
    done()

if __name__ == "__main__":
    main()
    dist.barrier()
    dist.destroy_process_group()
