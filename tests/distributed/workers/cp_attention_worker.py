"""Context-parallel attention on real gloo processes (launched by tests/distributed/test_cp_attention.py).

The CP size is the world size. Every rank builds the same full-sequence inputs from fixed seeds,
keeps its CP part, and compares against a reference computed in the same process on the full
sequence:
  1. cp=1: ContextParallelDotProductAttention == Megatron's DotProductAttention (values, grads).
  2. the module alone at cp=world (MHA, GQA, and a caller-given padding mask): gathered output and
     q/k/v gradients == plain causal attention on the full sequence, in float64.
  3. a tiny GPTModel built from `local_layer_spec()` at cp=world == the same weights at cp=1:
     rotary table slice, logits, and parameter gradients (summed over CP ranks), in float32.
  4. clear errors for what the module refuses.
  5. packed rows (integer segment ids as the mask) at cp=1 and cp=world == the full-sequence reference
     under the block-diagonal causal mask (model/packed_rows.py:packed_attention_mask), float64.
Exits non-zero on the first failure.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from torch.testing import assert_close

import megatron.core  # noqa: F401  (patches apply after megatron is imported)
from megatron_gspo.platform.cpu import apply_cpu_patches

apply_cpu_patches()

from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_gspo.model.packed_rows import packed_attention_mask  # noqa: E402
from megatron_gspo.model.spec import local_layer_spec  # noqa: E402
from megatron_gspo.parallel.context_parallel import gather_from_cp, split_for_cp  # noqa: E402
from megatron_gspo.parallel.cp_attention import ContextParallelDotProductAttention  # noqa: E402

from checks import check, done  # noqa: E402

SEQ, BATCH, HEAD_DIM = 16, 2, 8


def attention_config(n_heads: int, n_groups: int, cp_size: int) -> TransformerConfig:
    return TransformerConfig(
        num_layers=1, hidden_size=n_heads * HEAD_DIM, num_attention_heads=n_heads,
        num_query_groups=n_groups, kv_channels=HEAD_DIM, context_parallel_size=cp_size,
        attention_dropout=0.0, hidden_dropout=0.0,
    )


def causal_mask(seq: int) -> torch.Tensor:
    """[S, S], True = masked: key j is hidden from query i when j > i."""
    return torch.ones(seq, seq, dtype=torch.bool).triu(diagonal=1)


def padded_causal_mask() -> torch.Tensor:
    """[b, 1, S, S]: causal, and in batch row 1 the last 5 keys are padding."""
    mask = causal_mask(SEQ).repeat(BATCH, 1, 1, 1)
    mask[1, :, :, SEQ - 5:] = True
    return mask


def reference_attention(q, k, v, mask):
    """Textbook attention on the full sequence: q [S,b,np,hn], k/v [S,b,ng,hn] -> [S,b,np*hn]."""
    rep = q.size(2) // k.size(2)
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("qbnh,kbnh->bnqk", q, k) / math.sqrt(q.size(-1))
    probs = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
    return torch.einsum("bnqk,kbnh->qbnh", probs, v).reshape(q.size(0), q.size(1), -1)


def random_qkv(n_heads: int, n_groups: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(SEQ, BATCH, n_heads, HEAD_DIM, generator=g, dtype=dtype)
    k = torch.randn(SEQ, BATCH, n_groups, HEAD_DIM, generator=g, dtype=dtype)
    v = torch.randn(SEQ, BATCH, n_groups, HEAD_DIM, generator=g, dtype=dtype)
    upstream = torch.randn(SEQ, BATCH, n_heads * HEAD_DIM, generator=g, dtype=dtype)
    return q, k, v, upstream


def forward_backward(module, q, k, v, upstream, mask):
    """Run `module` on leaf copies of q, k, v; return output and the input gradients."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = module(*leaves, mask)
    (out * upstream).sum().backward()
    return out.detach(), *(t.grad for t in leaves)


@check("cp=1 equals DotProductAttention")
def check_cp1_matches_megatron(tp_group, solo_cp_group):
    """At cp=1 the module is DotProductAttention: same values and grads, bit for bit."""
    config = attention_config(n_heads=4, n_groups=2, cp_size=1)
    ours = ContextParallelDotProductAttention(
        config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
        pg_collection=ProcessGroupCollection(tp=tp_group, cp=solo_cp_group))
    theirs = DotProductAttention(
        config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
        pg_collection=ProcessGroupCollection(tp=tp_group))
    q, k, v, upstream = random_qkv(4, 2, torch.float32, seed=1)
    for mask in (None, padded_causal_mask()):
        got = forward_backward(ours, q, k, v, upstream, mask)
        want = forward_backward(theirs, q, k, v, upstream, mask)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"cp=1 vs DotProductAttention {name}: {m}")


def check_attention_alone(cp_group, n_heads, n_groups, with_padding):
    """Module at cp=world on this rank's chunks == full-sequence reference (float64)."""
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    module = ContextParallelDotProductAttention(
        attention_config(n_heads, n_groups, cp_size), layer_number=1,
        attn_mask_type=AttnMaskType.causal, attention_type="self")  # groups from parallel_state
    q, k, v, upstream = random_qkv(n_heads, n_groups, torch.float64, seed=2 + n_groups)
    full_mask = padded_causal_mask() if with_padding else causal_mask(SEQ)

    local = [split_for_cp(t, cp_size, cp_rank, seq_dim=0) for t in (q, k, v, upstream)]
    # A caller's mask is sliced like Megatron-LM's get_batch_on_this_cp_rank: query rows only.
    local_mask = split_for_cp(full_mask, cp_size, cp_rank, seq_dim=2) if with_padding else None
    got = [gather_from_cp(t, cp_group, seq_dim=0)
           for t in forward_backward(module, *local, local_mask)]

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = reference_attention(*leaves, full_mask)
    (ref_out * upstream).sum().backward()
    want = [ref_out.detach(), *(t.grad for t in leaves)]

    case = f"cp={cp_size} np={n_heads} ng={n_groups} padding={with_padding}"
    with check(f"attention alone matches the full sequence, {case}"):
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m: f"{case} {name}: {m}")


PACKED_SEGMENTS = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2, 2, -1, -1],
                                [0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3]])


def check_packed_rows(group, name):
    """Packed rows (integer segment ids as the mask: the varlen path) == the full-sequence reference
    under the block-diagonal causal mask, values and q/k/v gradients, GQA, on `group`'s CP layout."""
    cp_size, cp_rank = group.size(), group.rank()
    module = ContextParallelDotProductAttention(
        attention_config(4, 2, cp_size), layer_number=1, attn_mask_type=AttnMaskType.causal,
        attention_type="self", pg_collection=ProcessGroupCollection(
            tp=parallel_state.get_tensor_model_parallel_group(), cp=group))
    q, k, v, upstream = random_qkv(4, 2, torch.float64, seed=9)
    local = [split_for_cp(t, cp_size, cp_rank, seq_dim=0) for t in (q, k, v, upstream)]
    got = [gather_from_cp(t, group, seq_dim=0) if cp_size > 1 else t
           for t in forward_backward(module, *local, PACKED_SEGMENTS.clone())]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = reference_attention(*leaves, packed_attention_mask(PACKED_SEGMENTS))
    (ref_out * upstream).sum().backward()
    want = [ref_out.detach(), *(t.grad for t in leaves)]
    with check(f"packed rows (segment ids) match the block-diagonal reference, {name}"):
        for what, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m: f"packed {name} {what}: {m}")


def tiny_gpt(config: TransformerConfig, pg_collection=None) -> GPTModel:
    return GPTModel(config, local_layer_spec(), vocab_size=256, max_sequence_length=SEQ,
                    position_embedding_type="rope", pg_collection=pg_collection)


def check_gpt_model(cp_group, solo_cp_group):
    """GPTModel at cp=world on this rank's tokens == the same weights at cp=1 on all tokens."""
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
        ffn_hidden_size=128, normalization="RMSNorm", qk_layernorm=True, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False,
        attention_dropout=0.0, hidden_dropout=0.0, context_parallel_size=cp_size,
        use_cpu_initialization=True,
    )
    torch.manual_seed(1234)
    model = tiny_gpt(config)  # groups from parallel_state: the real CP group
    # The reference: same weights, cp=1, its attention given a one-rank CP group.
    reference_groups = ProcessGroupCollection.use_mpu_process_groups()
    reference_groups.cp = solo_cp_group
    config_1 = dataclasses.replace(config, context_parallel_size=1)
    reference = tiny_gpt(config_1, reference_groups)
    reference.load_state_dict(model.state_dict())

    # Rotary table: this rank must hold the angles of its own global positions.
    # (rotary_pos_emb is called with the full length, as GPTModel does: local length * cp.)
    with check("GPTModel: rotary table slice"):
        assert_close(model.rotary_pos_emb(SEQ),
                     split_for_cp(reference.rotary_pos_emb(SEQ), cp_size, cp_rank, seq_dim=0),
                     rtol=0, atol=0, msg=lambda m: f"cp={cp_size} rotary table slice: {m}")

    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 256, (BATCH, SEQ), generator=g)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    logit_weights = torch.randn(BATCH, SEQ, 256, generator=g)

    logits = model(split_for_cp(tokens, cp_size, cp_rank), split_for_cp(positions, cp_size, cp_rank),
                   attention_mask=None)
    (logits * split_for_cp(logit_weights, cp_size, cp_rank)).sum().backward()
    ref_logits = reference(tokens, positions, attention_mask=None)
    (ref_logits * logit_weights).sum().backward()

    with check("GPTModel: logits match cp=1"):
        assert_close(logits, split_for_cp(ref_logits, cp_size, cp_rank), rtol=1e-5, atol=1e-5,
                     msg=lambda m: f"cp={cp_size} logits: {m}")
    ref_params = dict(reference.named_parameters())
    with check("GPTModel: parameter gradients summed over CP match cp=1"):
        for name, param in model.named_parameters():
            # Each rank saw part of the tokens; the weight gradient is the sum over CP ranks
            # (what Megatron's DDP does over the dp x cp group).
            grad = param.grad.clone()
            dist.all_reduce(grad, group=cp_group)
            want = ref_params[name].grad
            assert_close(grad, want, rtol=1e-5, atol=1e-5 * want.abs().max().item(),
                         msg=lambda m: f"cp={cp_size} grad {name}: {m}")


@check("refuses packed sequences, dropout and a wrong CP size")
def check_refusals(cp_size):
    config = attention_config(4, 2, cp_size)
    module = ContextParallelDotProductAttention(config, 1, AttnMaskType.causal, "self")
    q, k, v, _ = random_qkv(4, 2, torch.float32, seed=0)
    try:
        module(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="thd"))
    except NotImplementedError:
        pass
    else:
        raise AssertionError("packed_seq_params was not refused")
    for bad, error in (({"attention_dropout": 0.1}, ValueError),
                       ({"context_parallel_size": cp_size + 1}, ValueError)):
        try:
            ContextParallelDotProductAttention(
                dataclasses.replace(config, **bad), 1, AttnMaskType.causal, "self")
        except error:
            continue
        raise AssertionError(f"{bad} was not refused")


def main():
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    parallel_state.initialize_model_parallel(context_parallel_size=world)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)  # DotProductAttention forks the RNG tracker
    cp_group = parallel_state.get_context_parallel_group()
    # One-rank CP groups for the cp=1 references (new_group is collective: every rank makes all).
    solo_cp_group = [dist.new_group([r]) for r in range(world)][rank]

    check_cp1_matches_megatron(parallel_state.get_tensor_model_parallel_group(), solo_cp_group)
    for n_groups in (4, 2):
        check_attention_alone(cp_group, n_heads=4, n_groups=n_groups, with_padding=False)
    check_attention_alone(cp_group, n_heads=4, n_groups=2, with_padding=True)
    check_packed_rows(solo_cp_group, "cp=1")
    check_packed_rows(cp_group, f"cp={world}")
    check_gpt_model(cp_group, solo_cp_group)
    check_refusals(world)

    dist.barrier()
    done()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
