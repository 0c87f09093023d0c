"""vocab_parallel_logprobs on one process against a float64 log_softmax + gather reference.

Shapes: T tokens, V vocab (one shard = the whole vocab here; tests/distributed covers TP > 1).
"""
import math

import pytest
import torch

from megatron_gspo.loss.logprobs import vocab_parallel_logprobs


def reference(logits, targets, temperature=1.0, vocab_size=None):
    """float64 log-probs and entropy over the first vocab_size columns, differentiable."""
    x = logits[..., :vocab_size].double() / temperature
    logp = torch.log_softmax(x, dim=-1)
    return logp.gather(-1, targets[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def make(T=37, V=50, dtype=torch.float32, scale=3.0, vocab_size=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(T, V, generator=g) * scale).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab_size or V, (T,), generator=g)
    up_lp, up_h = torch.randn(2, T, generator=g, dtype=torch.float64)  # upstream gradients
    return logits, targets, up_lp, up_h


def grads(logits, targets, up_lp, up_h, which, fn):
    """d(sum up_lp * logprob + sum up_h * entropy)/d logits, for the outputs named in `which`."""
    lp, h = fn(logits, targets)
    loss = 0
    if "lp" in which:
        loss = loss + (lp * up_lp.to(lp.dtype)).sum()
    if "h" in which:
        loss = loss + (h * up_h.to(h.dtype)).sum()
    (g,) = torch.autograd.grad(loss, logits)
    return lp.detach(), h.detach(), g


def ours(inplace=False, **kw):
    """inplace=True runs on a non-leaf copy of the logits (a leaf that requires grad is refused), so
    that the gradient still lands on the caller's leaf and the caller's logits stay intact."""
    if inplace:
        return lambda logits, targets: vocab_parallel_logprobs(logits.clone(), targets, with_entropy=True,
                                                               inplace=True, **kw)
    return lambda logits, targets: vocab_parallel_logprobs(logits, targets, with_entropy=True, **kw)


def ours_lp_only(inplace=False, **kw):
    """with_entropy=False (in place, the logits then keep exp(x - m) rather than x - m); entropy 0."""
    def fn(logits, targets):
        lp = vocab_parallel_logprobs(logits.clone() if inplace else logits, targets, inplace=inplace, **kw)
        return lp, torch.zeros_like(lp)
    return fn


def ref(**kw):
    return lambda logits, targets: reference(logits, targets, **kw)


@pytest.mark.parametrize("inplace", [False, True], ids=["copy", "inplace"])
@pytest.mark.parametrize("which", ["lp", "h", "lp+h"])
@pytest.mark.parametrize("kw", [{}, {"temperature": 0.7}, {"vocab_size": 43},
                                {"temperature": 1.6, "vocab_size": 41}],
                         ids=["plain", "temp0.7", "padded", "temp1.6+padded"])
def test_values_and_gradients_fp32(which, kw, inplace):
    logits, targets, up_lp, up_h = make(vocab_size=kw.get("vocab_size"))
    lp, h, g = grads(logits, targets, up_lp, up_h, which, ours(inplace=inplace, **kw))
    lp_ref, h_ref, g_ref = grads(logits, targets, up_lp, up_h, which, ref(**kw))
    assert lp.dtype == h.dtype == torch.float32
    torch.testing.assert_close(lp.double(), lp_ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(h.double(), h_ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(g.double(), g_ref.double(), atol=2e-5, rtol=1e-5)
    if "vocab_size" in kw:
        assert g[:, kw["vocab_size"]:].eq(0).all()  # padded columns: exactly zero gradient


@pytest.mark.parametrize("inplace", [False, True], ids=["copy", "inplace"])
def test_bf16_inputs_give_float32_outputs_and_bf16_gradient(inplace):
    logits, targets, up_lp, up_h = make(dtype=torch.bfloat16, vocab_size=45)
    lp, h, g = grads(logits, targets, up_lp, up_h, "lp+h", ours(inplace, vocab_size=45, temperature=0.9))
    # The reference sees the same bf16 values, so only the float32 arithmetic differs...
    lp_ref, h_ref, g_ref = grads(logits, targets, up_lp, up_h, "lp+h", ref(vocab_size=45, temperature=0.9))
    assert lp.dtype == h.dtype == torch.float32 and g.dtype == torch.bfloat16
    torch.testing.assert_close(lp.double(), lp_ref, atol=5e-5, rtol=1e-5)
    torch.testing.assert_close(h.double(), h_ref, atol=5e-5, rtol=1e-5)
    # ... and the gradient is rounded once to bf16 (8 bits of mantissa: relative 2^-9).
    torch.testing.assert_close(g.double(), g_ref.double(), atol=1e-3 * g_ref.abs().max().item(), rtol=2**-8)


@pytest.mark.parametrize("inplace", [False, True], ids=["copy", "inplace"])
@pytest.mark.parametrize("chunk_size", [1, 4, 10, 36, 37, 100])
def test_chunked_equals_unchunked(chunk_size, inplace):
    logits, targets, up_lp, up_h = make(vocab_size=47)
    kw = {"vocab_size": 47, "temperature": 0.8}
    whole = grads(logits, targets, up_lp, up_h, "lp+h", ours(chunk_size=0, **kw))
    chunked = grads(logits, targets, up_lp, up_h, "lp+h", ours(inplace, chunk_size=chunk_size, **kw))
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("which", ["lp+h", "lp"])
@pytest.mark.parametrize("inplace", [False, True], ids=["copy", "inplace"])
def test_qwen3_vocab_precision(inplace, which):
    # 151936 ids: float32 sums over a vocabulary this long must not lose digits (a BLAS dot product
    # for the entropy's sum p*x lost ~1e-3 here; torch's cascade sum keeps ~1e-6). "lp" alone takes
    # the in-place path that keeps exp(x - m) rather than x - m in the logits.
    logits, targets, up_lp, up_h = make(T=6, V=151936, scale=3.0)
    fn = ours_lp_only(inplace) if which == "lp" else ours(inplace)
    lp, h, g = grads(logits, targets, up_lp, up_h, which, fn)
    lp_ref, h_ref, g_ref = grads(logits, targets, up_lp, up_h, which, ref())
    torch.testing.assert_close(lp.double(), lp_ref, atol=1e-5, rtol=0)
    if which == "lp+h":
        torch.testing.assert_close(h.double(), h_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(g.double(), g_ref.double(), atol=1e-6, rtol=1e-5)


def test_leading_shape_is_kept():
    logits, targets, up_lp, up_h = make(T=24)
    logits_BSV = logits.detach().view(4, 6, -1).requires_grad_()
    lp, h, g = grads(logits_BSV, targets.view(4, 6), up_lp.view(4, 6), up_h.view(4, 6), "lp+h", ours())
    lp_ref, h_ref, g_ref = grads(logits, targets, up_lp, up_h, "lp+h", ref())
    assert lp.shape == h.shape == (4, 6) and g.shape == logits_BSV.shape
    torch.testing.assert_close(lp.double().view(-1), lp_ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(g.double().view_as(g_ref), g_ref.double(), atol=2e-5, rtol=1e-5)


def test_logprob_alone_and_no_grad():
    logits, targets, _, _ = make()
    lp_ref, _ = reference(logits.detach(), targets)
    with torch.no_grad():
        lp = vocab_parallel_logprobs(logits, targets, chunk_size=5)
    assert lp.dtype == torch.float32 and not lp.requires_grad
    torch.testing.assert_close(lp.double(), lp_ref, atol=2e-5, rtol=1e-5)


def test_uniform_logits_by_hand():
    # Uniform logits over V ids: p = 1/V, so logprob = -log V and entropy = log V, whatever the
    # temperature. d logprob/d logit_j = (onehot_j - 1/V) / temperature; d entropy/d logit_j =
    # -p_j (log p_j + H) / temperature = -(1/V)(-log V + log V) / temperature = 0.
    V, temp = 8, 2.0
    logits = torch.full((1, V), 5.0, requires_grad=True)
    lp, h = vocab_parallel_logprobs(logits, torch.tensor([3]), temperature=temp, with_entropy=True)
    assert lp.item() == pytest.approx(-math.log(V), abs=1e-6)
    assert h.item() == pytest.approx(math.log(V), abs=1e-6)
    (g_lp,) = torch.autograd.grad(lp.sum(), logits, retain_graph=True)
    expected = torch.full((1, V), -1 / V / temp)
    expected[0, 3] += 1 / temp
    torch.testing.assert_close(g_lp, expected)
    (g_h,) = torch.autograd.grad(h.sum(), logits)
    torch.testing.assert_close(g_h, torch.zeros(1, V))


@pytest.mark.parametrize("inplace", [False, True], ids=["copy", "inplace"])
def test_extreme_logits_are_finite_and_right(inplace):
    logits, targets, up_lp, up_h = make(T=16, V=40)
    with torch.no_grad():
        logits.copy_(torch.randint(0, 2, logits.shape) * 2e4 - 1e4)  # +-1e4 everywhere
        logits[0] = 1e4  # a row with many equal maxima
        logits[1] = -1e4
    lp, h, g = grads(logits, targets, up_lp, up_h, "lp+h", ours(inplace, chunk_size=3, temperature=0.5))
    lp_ref, h_ref, g_ref = grads(logits, targets, up_lp, up_h, "lp+h", ref(temperature=0.5))
    assert torch.isfinite(lp).all() and torch.isfinite(h).all() and torch.isfinite(g).all()
    # Likely tokens to 1e-5 absolute; the unlikely ones (~ -4e4) to fp32's relative precision.
    torch.testing.assert_close(lp.double(), lp_ref, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(h.double(), h_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g.double(), g_ref.double(), atol=1e-5, rtol=1e-5)


def test_out_of_range_targets_stay_finite():
    logits, _, _, _ = make(T=4, V=10)
    lp = vocab_parallel_logprobs(logits, torch.tensor([-100, 9, 10, 3]), vocab_size=9)
    assert torch.isfinite(lp).all()
    (g,) = torch.autograd.grad(lp.sum(), logits)
    assert torch.isfinite(g).all() and g[:, 9].eq(0).all()


def test_empty_input():
    logits = torch.randn(0, 7, requires_grad=True)
    lp, h = vocab_parallel_logprobs(logits, torch.zeros(0, dtype=torch.long), with_entropy=True)
    assert lp.shape == h.shape == (0,)
    (g,) = torch.autograd.grad(lp.sum() + h.sum(), logits)
    assert g.shape == (0, 7)


@pytest.mark.parametrize("kw", [{"temperature": 0.0}, {"vocab_size": 51}, {"vocab_size": 0},
                                {"chunk_size": -1}])
def test_bad_arguments_raise(kw):
    logits, targets, _, _ = make()
    with pytest.raises(ValueError):
        vocab_parallel_logprobs(logits, targets, **kw)


# ------------------------------------------------------------------------------- inplace=True

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("which", ["lp", "h", "lp+h", "lp-only-call"])
@pytest.mark.parametrize("kw", [{}, {"temperature": 0.7, "chunk_size": 4},
                                {"vocab_size": 43, "chunk_size": 0},
                                {"temperature": 1.6, "vocab_size": 41, "chunk_size": 10}],
                         ids=["plain", "temp0.7+chunk4", "padded+1chunk", "temp1.6+padded+chunk10"])
def test_inplace_equals_copy(kw, which, dtype):
    # Same values bit for bit; the gradient to float32 rounding (the in-place backward of the
    # log-prob alone scales the stored exp(x - m) instead of recomputing exp(x - M)).
    logits, targets, up_lp, up_h = make(vocab_size=kw.get("vocab_size"), dtype=dtype)
    fn = ours
    if which == "lp-only-call":  # with_entropy=False: the logits keep exp(x - m), not x - m
        fn, which = ours_lp_only, "lp"
    lp0, h0, g0 = grads(logits, targets, up_lp, up_h, which, fn(False, **kw))
    lp1, h1, g1 = grads(logits, targets, up_lp, up_h, which, fn(True, **kw))
    assert g1.dtype == dtype
    torch.testing.assert_close(lp1, lp0, atol=0, rtol=0)
    torch.testing.assert_close(h1, h0, atol=0, rtol=0)
    tol = dict(atol=1e-7, rtol=1e-6) if dtype == torch.float32 else dict(atol=0, rtol=0)
    torch.testing.assert_close(g1, g0, **tol)
    if "vocab_size" in kw:
        assert g1[:, kw["vocab_size"]:].eq(0).all()


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("batch", [3, 1], ids=["B3", "B1-view"])
def test_inplace_on_linear_output(batch, with_entropy):
    # The use it is made for: the output layer's logits, a non-leaf, overwritten and turned into
    # the gradient in place; the gradients of the layer's input and weight are the copy path's.
    # With one sequence, transpose(0, 1).contiguous() (as GPTModel returns) is a view of the
    # linear's output: the in-place path must handle views too.
    torch.manual_seed(0)
    S, H, V = 7, 16, 50
    hidden = torch.randn(S, batch, H, requires_grad=True)
    linear = torch.nn.Linear(H, V)
    targets = torch.randint(0, 45, (batch, S))
    results = []
    for inplace in (False, True):
        hidden.grad = None
        linear.zero_grad()
        y = linear(hidden).transpose(0, 1).contiguous()
        assert (y._base is not None) == (batch == 1)
        before = y.detach().clone()
        out = vocab_parallel_logprobs(y, targets, temperature=0.8, vocab_size=45, chunk_size=3,
                                      with_entropy=with_entropy, inplace=inplace)
        lp, h = out if with_entropy else (out, torch.zeros(()))
        assert torch.equal(y.detach(), before) != inplace  # overwritten exactly when asked
        (lp.sum() + 0.5 * h.sum()).backward()
        results.append((lp.detach(), h.detach(), hidden.grad, linear.weight.grad, linear.bias.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-6)


def test_inplace_returns_the_logits_buffer_as_gradient():
    torch.manual_seed(0)
    hidden = torch.randn(6, 16, requires_grad=True)
    y = torch.nn.Linear(16, 50)(hidden)
    seen = []
    y.register_hook(lambda grad: seen.append(grad.data_ptr()))
    vocab_parallel_logprobs(y, torch.randint(0, 50, (6,)), inplace=True).sum().backward()
    assert seen == [y.data_ptr()]


def test_inplace_refuses_a_leaf_and_guards_other_saved_uses():
    logits, targets, _, _ = make()
    with pytest.raises(ValueError, match="leaf"):
        vocab_parallel_logprobs(logits, targets, inplace=True)
    with pytest.raises(ValueError, match="leaf"):
        vocab_parallel_logprobs(logits.view(-1, 50), targets, inplace=True)
    y = logits * 2
    squared = y.pow(2)  # saves y for its backward: the overwrite must be caught, not used silently
    lp = vocab_parallel_logprobs(y, targets, inplace=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (lp.sum() + squared.sum()).backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inplace_counts_as_modifying_the_logits_in_the_forward(dtype):
    # float32 logits are overwritten in the forward, bf16 ones only in the backward; either way the
    # call counts as modifying them, so an op that saved them earlier raises even when its backward
    # runs on its own, before the log-probs' one.
    logits, targets, _, _ = make(dtype=dtype)
    y = logits * 2
    squared = y.pow(2)
    vocab_parallel_logprobs(y, targets, inplace=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        squared.float().sum().backward()


def test_inplace_without_grad_and_empty():
    logits, targets, _, _ = make()
    with torch.no_grad():
        expected = vocab_parallel_logprobs(logits, targets, chunk_size=5, with_entropy=True)
        got = vocab_parallel_logprobs(logits.clone(), targets, chunk_size=5, with_entropy=True, inplace=True)
        # a leaf that requires grad is fine where no gradient is taken
        lp = vocab_parallel_logprobs(logits.detach().clone().requires_grad_(), targets, inplace=True)
    for a, b in zip(expected, got):
        torch.testing.assert_close(b, a, atol=0, rtol=0)
    torch.testing.assert_close(lp, expected[0], atol=0, rtol=0)
    y = torch.randn(0, 7, requires_grad=True) * 1
    lp, h = vocab_parallel_logprobs(y, torch.zeros(0, dtype=torch.long), with_entropy=True, inplace=True)
    assert lp.shape == h.shape == (0,)
