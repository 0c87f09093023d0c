"""MoE routing bookkeeping (model/routing.py) on hand-built cases: the changed-fraction metric, the token
order the routers see, the rollout routing rows of a packed micro-batch, and the ratio-spread metrics."""
from __future__ import annotations

import pytest
import torch

from megatron_gspo.loss.policy import policy_loss, summarize_metrics
from megatron_gspo.model.routing import ChangeCounts, router_order, routing_dtype, topk_sets_differ
from megatron_gspo.training.packing import Response, pack_minibatch, routing_rows


def test_changed_fraction_on_two_layers_with_known_topk_sets():
    # 4 tokens, top-2. Layer 0: token 1 changes {1,2} -> {1,3}; token 2 only swaps the order (not a change).
    # Layer 1: tokens 0 and 3 change, token 3 is not a response token (masked out).
    before = [torch.tensor([[0, 1], [1, 2], [2, 3], [0, 3]]), torch.tensor([[0, 1], [0, 1], [2, 3], [1, 2]])]
    after = [torch.tensor([[0, 1], [1, 3], [3, 2], [0, 3]]), torch.tensor([[2, 3], [1, 0], [2, 3], [0, 3]])]
    mask = torch.tensor([True, True, True, False])
    counts = ChangeCounts.zeros(2)
    for layer in range(2):
        counts.add(layer, after[layer].to(torch.uint8), before[layer].to(torch.uint8), mask)
    assert counts.changed_L.tolist() == [1.0, 1.0]
    assert counts.tokens_L.tolist() == [3.0, 3.0]
    assert counts.changed_L.sum() / counts.tokens_L.sum() == pytest.approx(2 / 6)


def test_topk_sets_ignore_order_but_not_membership():
    a = torch.tensor([[3, 1], [0, 2], [5, 4]])
    b = torch.tensor([[1, 3], [0, 1], [4, 5]])
    assert topk_sets_differ(a, b).tolist() == [False, True, False]


def test_router_order_is_position_major_and_sequence_parallel_split():
    # [B=2, S=4] ids b*10+s; the router sees [S, B] flattened, cut along S over TP ranks.
    x_BS = torch.tensor([[0, 1, 2, 3], [10, 11, 12, 13]])
    assert router_order(x_BS, tp_size=1, tp_rank=0, sequence_parallel=False).tolist() == [0, 10, 1, 11, 2, 12, 3, 13]
    assert router_order(x_BS, tp_size=2, tp_rank=0, sequence_parallel=True).tolist() == [0, 10, 1, 11]
    assert router_order(x_BS, tp_size=2, tp_rank=1, sequence_parallel=True).tolist() == [2, 12, 3, 13]
    # trailing dims ride along: [B, S, L, k] -> [T, L, k]
    assert router_order(torch.zeros(2, 4, 3, 2), tp_size=2, tp_rank=1, sequence_parallel=True).shape == (4, 3, 2)


def test_routing_dtype():
    assert routing_dtype(128) == torch.uint8 and routing_dtype(256) == torch.uint8
    assert routing_dtype(257) == torch.int16


def _routed(P, R, L=2, k=2, offset=0):
    return (torch.arange((P + R - 1) * L * k).reshape(P + R - 1, L, k) + offset).to(torch.uint8).numpy()


def test_routing_rows_align_with_input_positions_and_pad_with_distinct_experts():
    a = Response([1, 2, 3], [4, 5], 1.0, routed_experts=_routed(3, 2))        # 4 input positions fed
    b = Response([7], [8, 9, 10], -1.0, routed_experts=_routed(1, 3, offset=100))
    rows = routing_rows([a, b], 6)
    assert rows.shape == (2, 6, 2, 2) and rows.dtype == torch.uint8
    assert torch.equal(rows[0, :4], torch.as_tensor(a.routed_experts))
    assert torch.equal(rows[1, :3], torch.as_tensor(b.routed_experts))
    assert rows[0, 4:].tolist() == [[[0, 1], [0, 1]]] * 2  # the last response token and padding: experts 0..k-1
    packed = pack_minibatch([a, b], dp_size=1, dp_rank=0, max_tokens=64, pad_multiple=4)
    (mb,) = packed.micro_batches
    order = packed.rows[0]
    for row, i in enumerate(order):
        n = len([a, b][i].prompt_ids) + len([a, b][i].response_ids) - 1
        assert torch.equal(mb.routing_BSLk[row, :n], torch.as_tensor([a, b][i].routed_experts))
    # The CP split cuts the routing along positions like the tokens.
    part = mb.for_cp_rank(2, 1)
    assert part.routing_BSLk.shape[1] == part.tokens_BS.shape[1]


def test_routing_rows_name_the_response_with_a_wrong_shape():
    bad = Response([1, 2, 3], [4, 5], 1.0, routed_experts=_routed(3, 3))
    with pytest.raises(ValueError, match=r"response 0: routed_experts of shape \(5, 2, 2\), expected \(4, 2, 2\)"):
        routing_rows([bad], 6)


def test_no_routing_rows_unless_every_response_has_them():
    a = Response([1, 2, 3], [4, 5], 1.0, routed_experts=_routed(3, 2))
    b = Response([7], [8, 9, 10], -1.0)
    (mb,) = pack_minibatch([a, b], dp_size=1, dp_rank=0, max_tokens=64).micro_batches
    assert mb.routing_BSLk is None and mb.rows(0, 1).routing_BSLk is None


def test_log_ratio_spreads_are_the_std_of_token_and_sequence_log_ratios():
    g = torch.Generator().manual_seed(0)
    lengths = [3, 5, 2]
    cu = torch.tensor([0, 3, 8, 10])
    old = torch.randn(10, generator=g)
    log_w = 0.1 * torch.randn(10, generator=g)
    mask = torch.ones(10)
    _, _, raw = policy_loss(old + log_w, old, torch.tensor([1.0, -1.0, 0.5]), mask, cu, algorithm="grpo")
    metrics = summarize_metrics(raw)
    log_s = torch.stack([log_w[int(cu[i]):int(cu[i + 1])].mean() for i in range(len(lengths))])
    assert metrics["loss/log_ratio_token_std"] == pytest.approx(log_w.double().std(unbiased=False).item(), rel=1e-5)
    assert metrics["loss/log_ratio_seq_std"] == pytest.approx(log_s.double().std(unbiased=False).item(), rel=1e-5)
