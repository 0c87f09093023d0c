"""Each CPU platform patch is needed: without it its probe fails, with it the probe passes.

usage: torchrun --nproc-per-node 2 platform_patches.py

Runs at EP2 (two ranks), so the MoE all-to-all dispatcher really exchanges tokens. For every patch in
megatron_gspo.platform.cpu.PATCHES: run its probe (must pass), revert the patch and run the probe
again (must fail), re-apply it and run the probe once more (must pass). Only the patch differs
between the runs. Both ranks run the same code, so a probe fails on both at the
same point and no collective is left waiting.
"""
from __future__ import annotations

import dataclasses
import types

import torch
import torch.distributed as dist

from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_gspo.model.gpt import TINY_MOE, build_model, model_process_groups, transformer_config
from megatron_gspo.config import ParallelConfig
from megatron_gspo.parallel.groups import init_megatron
from megatron_gspo.platform.cpu import PATCHES, CudaLiteralsToCpu, apply_cpu_patches, revert_cpu_patches
from megatron_gspo.training.forward_step import LossSettings, policy_forward_step
from megatron_gspo.microbatch import MicroBatch

from checks import check, done

LAYOUT = ParallelConfig(ep=2, dp=2)  # the 2 processes of tests/distributed/test_platform_patches.py


def train_step(wrap=lambda step: step) -> None:
    """Build the tiny MoE model and optimizer, run one GSPO step through Megatron's schedule."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config = transformer_config(TINY_MOE, LAYOUT)
    model = build_model(TINY_MOE, config, pgs=ProcessGroupCollection.use_mpu_process_groups())
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0), model)
    g = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, TINY_MOE.vocab_size, (2, 16), generator=g)
    batch = MicroBatch(tokens, tokens.roll(-1, 1), torch.ones(2, 16), torch.full((2, 16), -6.0),
                       torch.tensor([1.0, -1.0]))
    step = policy_forward_step(LossSettings(algorithm="gspo", temperature=1.0, vocab_size=TINY_MOE.vocab_size), pgs=model_process_groups(model),
                               num_global_sequences=4, num_microbatches=1)
    step = wrap(step)
    get_forward_backward_func()(forward_step_func=step, data_iterator=iter([batch]), model=model,
                                num_microbatches=1, seq_length=16, micro_batch_size=2, forward_only=False)
    ok, grad_norm, _ = optimizer.step()
    assert ok and grad_norm > 0


def reseed_rng_tracker() -> None:
    from megatron.core import tensor_parallel

    tensor_parallel.get_cuda_rng_tracker().reset()
    tensor_parallel.model_parallel_cuda_manual_seed(1234)


def sequence_parallel_norm() -> None:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = types.SimpleNamespace(layernorm_zero_centered_gamma=False, persist_layer_norm=False,
                                   memory_efficient_layer_norm=False, sequence_parallel=True,
                                   normalization="RMSNorm")
    norm = WrappedTorchNorm(config, 8)
    assert norm.weight.sequence_parallel  # finalize_model_grads all-reduces it over TP


def stock_attention_causal() -> None:
    """Megatron's own DotProductAttention with the default (attention_mask=None) causal mask."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    dense = dataclasses.replace(TINY_MOE, num_experts=None, moe_ffn_hidden_size=None)
    config = transformer_config(dense, ParallelConfig())
    attention = DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                    attention_type="self")
    heads, groups, dim = TINY_MOE.num_attention_heads, TINY_MOE.num_query_groups, TINY_MOE.head_dim
    q = torch.randn(6, 1, heads, dim)
    kv = torch.randn(6, 1, groups, dim)
    out = attention(q, kv, kv, None, attn_mask_type=AttnMaskType.causal)
    assert out.shape == (6, 1, heads * dim)


def cp_rotary_slice() -> None:
    """Megatron's CP slice of the rotary table, called outside a schedule (e.g. inference)."""
    from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank

    table = torch.arange(8.0).view(8, 1, 1, 1)
    mine = get_pos_emb_on_this_cp_rank(table, 0, dist.group.WORLD).flatten().tolist()
    assert mine == ([0.0, 1.0, 6.0, 7.0] if dist.get_rank() == 0 else [2.0, 3.0, 4.0, 5.0]), mine


def tied_embeddings_across_stages() -> None:
    """A dense model with tied embeddings split over 2 pipeline stages (the stages sync the copies)."""
    from megatron.core import parallel_state as ps

    dense = dataclasses.replace(TINY_MOE, num_experts=None, moe_ffn_hidden_size=None,
                                tie_word_embeddings=True)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    try:
        build_model(dense, transformer_config(dense, ParallelConfig(pp=2)), pgs=ProcessGroupCollection.use_mpu_process_groups(),
                    wrap_ddp=False)
    finally:
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(expert_model_parallel_size=LAYOUT.ep)


def grad_norm_precision() -> None:
    """Megatron's grad norm over a 4M-element gradient within 1e-6 of the float64 truth."""
    import megatron.core.optimizer.clip_grads as clip_grads

    grad = (torch.arange(4_000_000, dtype=torch.float32) % 977) * 1e-3 + 1.0
    param = torch.nn.Parameter(torch.zeros_like(grad))
    param.grad = grad
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    with CudaLiteralsToCpu():  # as the (patched) optimizer calls it
        norm = clip_grads.get_grad_norm_fp32([grad], grad_stats_parallel_group=alone)
    truth = grad.double().norm().item()
    assert abs(norm - truth) <= 1e-6 * truth, f"grad norm {norm} vs float64 {truth}"


PROBES = {
    "current_device": train_step,
    "streams": train_step,
    "rng_tracker": reseed_rng_tracker,
    "moe_router_gemm": train_step,
    "norm_sequence_parallel": sequence_parallel_norm,
    "alltoall_splits": train_step,
    "schedules": train_step,
    "optimizer": train_step,
    "causal_mask": stock_attention_causal,
    "cp_rotary_slice": cp_rotary_slice,
    "tied_embeddings_pp": tied_embeddings_across_stages,
    "grad_norm_float64": grad_norm_precision,
}


def main() -> None:
    init_megatron(LAYOUT)
    with check("every patch has a probe"):
        assert set(PROBES) == {p.name for p in PATCHES}, "every patch needs a probe"
    for patch in PATCHES:
        with check(f"patch {patch.name}: its probe passes with it and fails without it"):
            check_patch(patch)
    with check("forward and backward steps run outside the CUDA-literal mode the schedules need"):
        modes_inside_steps()
    done()
    dist.barrier()
    dist.destroy_process_group()


def modes_inside_steps() -> None:
    """The schedules run under CudaLiteralsToCpu; schedules.forward_step/backward_step leave it (a
    torch-function mode costs a Python call per op). Record the mode seen in the forward and the backward."""
    import megatron.core.pipeline_parallel.schedules as schedules

    seen = {}

    def recording(fn, key):
        def wrapper(*args, **kwargs):
            # first call only: under a mode, torch.autograd.backward re-enters itself via the mode
            seen.setdefault(key, torch.overrides._get_current_function_mode())
            return fn(*args, **kwargs)
        return wrapper

    real = torch.autograd.backward, schedules.custom_backward
    torch.autograd.backward = recording(real[0], "backward")
    schedules.custom_backward = recording(real[1], "backward")
    try:
        train_step(wrap=lambda step: recording(step, "forward"))
    finally:
        torch.autograd.backward, schedules.custom_backward = real
    assert set(seen) == {"forward", "backward"}, seen
    assert seen["forward"] is None and seen["backward"] is None, seen


def check_patch(patch) -> None:
    probe = PROBES[patch.name]
    probe()
    revert_cpu_patches((patch.name,))
    try:
        probe()
    except Exception as e:  # the failure we expect without the patch
        failure = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    else:
        raise AssertionError(f"probe {probe.__name__} passed without patch {patch.name}: "
                             f"the patch is not needed (or the probe does not reach {patch.upstream})")
    finally:
        apply_cpu_patches((patch.name,))
    probe()  # and passes again (this also restores what the failed run left half done)
    if dist.get_rank() == 0:
        print(f"patch {patch.name:24s} needed: without it {failure}")


if __name__ == "__main__":
    main()
