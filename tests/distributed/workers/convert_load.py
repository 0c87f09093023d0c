"""Converted HF checkpoints loaded into this project's Megatron model, layout after layout, in one launch.

usage: torchrun --nproc-per-node N convert_load.py WORKDIR STEP [STEP ...]
STEP: KIND[:key=value,...] with keys tp, pp, cp, ep (1 where absent; dp takes the other ranks:
trainer_common.worker_args), check=load|parity (load where absent) and resave=0|1 (0 where absent),
e.g. `moe` (every rank a full model), `moe:tp=2,ep=2,resave=1`, `moe:tp=2,check=parity`.

WORKDIR/KIND holds `hf/` (transformers' save_pretrained), `mcore/` (our conversion of it) and
`ref.pt` (tokens and transformers' float32 per-token log-probs). For each step, in order, on every rank:
check=load (3 checks):
  1. build the model (`build_model`, local spec on CPU) and load the converted checkpoint into it
     (`load_weights`: `dist_checkpointing.load` of exactly the keys the model asks for);
  2. per-token log-probs (the training forward step: `vocab_parallel_logprobs` on vocab-sharded
     logits, last pipeline stage) match transformers' within 1e-4;
  3. `iter_hf_tensors` yields every HF tensor of the checkpoint, bitwise equal, on every rank, and
     with dst=<last rank> on that rank only.
resave=1 (after check=load; 1 check more): Megatron saves the loaded model itself (sharded in that
layout, vocabulary padded), and rank 0 exports it with `convert_mcore_to_hf`: every tensor must equal
the original HF checkpoint bitwise.
check=parity (1 check) runs `check_parity` (the library behind tools/check_hf_mcore_parity.py) instead.
Checks name a layout as its sizes above 1 joined by "x" ("tp2xep2"), or "dp".
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_gspo.convert import convert_mcore_to_hf, read_hf_config
from megatron_gspo.convert.export import iter_hf_tensors
from megatron_gspo.convert.load import load_weights
from megatron_gspo.convert.safetensors_io import SafetensorsReader
from megatron_gspo.model.gpt import build_model, transformer_config
from megatron_gspo.config import ParallelConfig
from megatron_gspo.parallel.groups import init_megatron
from megatron_gspo.training.forward_step import LossSettings, logprobs_forward_step
from megatron_gspo.microbatch import MicroBatch

from checks import check, done
from trainer_common import LAYOUT_KEYS, worker_args

TOLERANCE = 1e-4


def label(layout: ParallelConfig) -> str:
    """e.g. "tp2xep2": the sizes above 1 joined by "x"; "dp" if every rank holds a full model."""
    return "x".join(f"{key}{getattr(layout, key)}" for key in LAYOUT_KEYS if getattr(layout, key) > 1) or "dp"


def load_and_check(workdir: Path, kind: str, layout: ParallelConfig, layout_name: str):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    shape = read_hf_config(workdir / kind / "hf")
    pgs = init_megatron(layout)
    where = f"[{kind}:{layout_name} rank {dist.get_rank()}]"
    model = build_model(shape, transformer_config(shape, layout), pgs=pgs, wrap_ddp=False)
    (module,) = model
    load_weights(model, workdir / kind / "mcore")
    module.eval()

    ref = torch.load(workdir / kind / "ref.pt")
    tokens = ref["tokens"]
    B, S = tokens.shape
    batch = MicroBatch(tokens, torch.roll(tokens, -1, dims=1), torch.ones(B, S), torch.zeros(B, S), torch.zeros(B))
    settings = LossSettings(algorithm="gspo", temperature=1.0, vocab_size=shape.vocab_size)
    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=logprobs_forward_step(settings, pgs=pgs),
            data_iterator=iter([batch]), model=model, num_microbatches=1, seq_length=S,
            micro_batch_size=B, forward_only=True)
    report = ""
    with check(f"{kind}:{layout_name}: log-probs match transformers within {TOLERANCE}"):
        if ps.is_pipeline_last_stage():
            logprobs = outputs[0]["logprobs"][:, :-1]
            diff = (logprobs - ref["logprobs"]).abs()
            assert diff.max() <= TOLERANCE, f"{where} log-probs differ from transformers by {diff.max():.2e}"
            report = f" logprob max diff {diff.max():.2e} mean {diff.mean():.2e} over {diff.numel()} tokens"

    hf = SafetensorsReader(workdir / kind / "hf")
    seen = set()
    with check(f"{kind}:{layout_name}: iter_hf_tensors gives back every HF tensor bitwise"):
        for name, tensor in iter_hf_tensors(model, shape):
            expected = hf.read(name)
            assert tensor.dtype == expected.dtype and tensor.shape == expected.shape and torch.equal(tensor, expected), \
                f"{where} exported {name} differs from the HF checkpoint"
            seen.add(name)
        assert seen == set(hf.tensors), f"{where} exported names differ: {sorted(seen ^ set(hf.tensors))[:5]}"
    with check(f"{kind}:{layout_name}: iter_hf_tensors(dst=last rank) yields them on that rank only"):
        # Only the last rank assembles (point to point); the others yield nothing.
        last = dist.get_world_size() - 1
        exported = dict(iter_hf_tensors(model, shape, dst=last))
        if dist.get_rank() == last:
            assert exported.keys() == hf.tensors.keys(), f"{where} dst export: names differ"
            for name, tensor in exported.items():
                assert tensor.dtype == hf.tensors[name].dtype and torch.equal(tensor, hf.read(name)), \
                    f"{where} dst export: {name} differs from the HF checkpoint"
        else:
            assert exported == {}, f"{where} a rank other than dst yielded {len(exported)} tensors"
    print(f"{where} load + export of {len(seen)} tensors bitwise{report}")
    return module


def resave_and_export(workdir: Path, kind: str, module, layout_name: str) -> None:
    from megatron.core import dist_checkpointing

    out = workdir / kind / f"resaved_{layout_name}"
    if dist.get_rank() == 0:
        out.mkdir()
    dist.barrier()
    dist_checkpointing.save({"model": module.sharded_state_dict()}, str(out))
    dist.barrier()
    with check(f"{kind} resaved by Megatron at {layout_name}: convert_mcore_to_hf exports it bitwise"):
        if dist.get_rank() == 0:
            exported = workdir / kind / f"exported_{layout_name}"
            convert_mcore_to_hf(out, workdir / kind / "hf", exported, progress=False)
            original, back = SafetensorsReader(workdir / kind / "hf"), SafetensorsReader(exported)
            assert set(original.tensors) == set(back.tensors)
            for name in original.tensors:
                assert torch.equal(original.read(name), back.read(name)), f"re-exported {name} differs"
            print(f"resave {kind} at {layout_name}: Megatron-saved checkpoint exports bitwise")
    dist.barrier()


def parity(workdir: Path, kind: str, layout: ParallelConfig, layout_name: str) -> None:
    """The library behind tools/check_hf_mcore_parity.py, run on the converted checkpoint."""
    from megatron_gspo.convert.parity import check_parity

    report = check_parity(workdir / kind / "hf", workdir / kind / "mcore", layout, seq_len=64)
    with check(f"parity {kind}:{layout_name}: check_parity within {TOLERANCE}, every argmax agrees"):
        if dist.get_rank() == 0:  # the report's rank
            assert report is not None, "check_parity returned no report on rank 0"
            assert report.max_abs_diff <= TOLERANCE and report.argmax_agreement == 1.0, report
            print(f"parity {kind}:{layout_name}: {report}")


def main() -> None:
    workdir = Path(sys.argv[1])
    for step in sys.argv[2:]:
        kind, _, args = step.partition(":")
        layout, options = worker_args(args.split(",") if args else [], check="load", resave=False)
        name = label(layout)
        if options.check == "load":
            module = load_and_check(workdir, kind, layout, name)
            if options.resave:
                resave_and_export(workdir, kind, module, name)
        elif options.check == "parity" and not options.resave:
            parity(workdir, kind, layout, name)
        else:
            raise ValueError(f"step {step!r}: check is load or parity, and resave=1 needs check=load")
    done()

if __name__ == "__main__":
    main()
    dist.barrier()
    dist.destroy_process_group()  # without it gloo can abort at exit
