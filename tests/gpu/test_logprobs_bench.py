"""vocab_parallel_logprobs forward + backward on a GPU at Qwen3's vocabulary, against Megatron-Core's two
cross entropies and the memory-bandwidth floor: T = 8192 tokens, V = 151936, bf16 logits (2.49 GB).

A benchmark-style test: it prints a table of times and asserts correctness only (log-probs and gradients
against a float32 log_softmax; Megatron's losses are minus the same log-probs, their gradients minus
ours), never speed. The floor is what moving the bytes costs at the copy bandwidth measured here (a
device-to-device copy, bytes read + written, the way KINDS.md measured ~4.3 TB/s on the H200) and at the
nominal one: the forward must read the logits once (1x), forward + backward read them twice and write
the gradient once (3x).

Skipped without CUDA. Run: python -m pytest tests/gpu/test_logprobs_bench.py -m gpu -s
"""
from __future__ import annotations

import statistics

import pytest
import torch
import torch.distributed as dist

from gpu_requirements import cuda_missing, skip_unless
from megatron_gspo.loss.logprobs import vocab_parallel_logprobs
from megatron_gspo.net import free_port

pytestmark = [pytest.mark.gpu, *skip_unless(cuda_missing())]
T, V = 8192, 151936
NOMINAL_TB_S = {"H200": 4.8, "H100": 3.35}  # vendor datasheets (SXM), TB/s


@pytest.fixture(scope="module")
def tp_group():
    """A one-process NCCL world with Megatron's model-parallel state (its unfused cross entropy reads the
    tensor-parallel group from the globals); destroyed after the module."""
    from megatron.core import parallel_state

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    yield parallel_state.get_tensor_model_parallel_group()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def data():
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(T, V, device="cuda", generator=g) * 3).to(torch.bfloat16)
    targets = torch.randint(0, V, (T,), device="cuda", generator=g)
    upstream = torch.randn(T, device="cuda", generator=g)  # a gradient with a different weight per token
    return logits, targets, upstream


def cuda_time_ms(fn, warmup: int = 2, iters: int = 5) -> float:
    """Median of `iters` timed calls (CUDA events), after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def fwd_bwd(loss_fn, logits, targets, upstream, sign: float, *, copy_first: bool = False):
    """logits -> per-token values -> backward of sum(sign * upstream * values); returns (values, grad).

    copy_first: the input is a fresh copy (a non-leaf), which in-place functions need; the copy's time
    is part of the measurement and reported on its own row.
    """
    leaf = logits.detach().requires_grad_()
    x = leaf.clone() if copy_first else leaf
    values = loss_fn(x, targets)
    (values * (sign * upstream)).sum().backward()
    return values.detach(), leaf.grad


def test_logprobs_fwd_bwd_vs_megatron_cross_entropy(tp_group, data):
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    logits, targets, upstream = data
    candidates = {
        # name: (per-token function of (logits [T, V], targets [T]), sign making it a log-prob, copy_first)
        "vocab_parallel_logprobs": (lambda x, t: vocab_parallel_logprobs(x, t), 1.0, False),
        "vocab_parallel_logprobs inplace": (lambda x, t: vocab_parallel_logprobs(x, t, inplace=True), 1.0, True),
        # Megatron's losses take [s, b, V] logits and [s, b] targets (b = 1 here).
        "megatron fused_vocab_parallel_cross_entropy": (
            lambda x, t: fused_vocab_parallel_cross_entropy(x[:, None], t[:, None], tp_group)[:, 0], -1.0, False),
        "megatron vocab_parallel_cross_entropy": (
            lambda x, t: vocab_parallel_cross_entropy(x[:, None], t[:, None])[:, 0], -1.0, False),
    }

    # Reference: float32 log_softmax of the same bf16 logits, and its exact gradient (3) in float32.
    ref_x = logits.float().requires_grad_()
    ref_lp = torch.log_softmax(ref_x, dim=-1).gather(1, targets[:, None])[:, 0]
    (ref_lp * upstream).sum().backward()
    ref_lp, ref_grad = ref_lp.detach(), ref_x.grad
    del ref_x

    results = {}
    for name, (fn, sign, copy_first) in candidates.items():
        values, grad = fwd_bwd(fn, logits, targets, upstream, sign, copy_first=copy_first)
        logprobs = sign * values.float()
        lp_err = (logprobs - ref_lp).abs().max().item()
        # bf16 gradient: one rounding of values |g| <= |upstream| (< ~5): 2^-8 relative, plus float32 noise.
        grad_err = (grad.float() - ref_grad).abs().max().item()
        grad_scale = ref_grad.abs().max().item()
        assert lp_err < 1e-3, (name, lp_err)
        assert grad_err <= 2 ** -7 * grad_scale + 1e-6, (name, grad_err, grad_scale)
        del values, grad
        ms = cuda_time_ms(lambda: fwd_bwd(fn, logits, targets, upstream, sign, copy_first=copy_first))
        results[name] = (ms, lp_err, grad_err)

    nbytes = logits.numel() * logits.element_size()
    copy_ms = cuda_time_ms(lambda: logits.clone())
    measured_tb_s = 2 * nbytes / (copy_ms * 1e-3) / 1e12  # a copy reads and writes every byte
    gpu = torch.cuda.get_device_name()
    nominal = next((bw for key, bw in NOMINAL_TB_S.items() if key in gpu), None)

    print(f"\n{gpu}: T={T} V={V} bf16 logits {nbytes / 1e9:.2f} GB; copy bandwidth {measured_tb_s:.2f} TB/s"
          f"{f', nominal {nominal} TB/s' if nominal else ''}")
    print(f"{'fwd+bwd':<46} {'ms':>8} {'x floor(3x)':>12} {'|lp err|':>10} {'|grad err|':>11}")
    floor_ms = 3 * nbytes / (measured_tb_s * 1e12) * 1e3
    for name, (ms, lp_err, grad_err) in results.items():
        print(f"{name:<46} {ms:8.2f} {ms / floor_ms:12.2f} {lp_err:10.2e} {grad_err:11.2e}")
    print(f"{'one copy of the logits (in the inplace row)':<46} {copy_ms:8.2f}")
    print(f"{'floor 1x (read once), measured bandwidth':<46} {floor_ms / 3:8.2f}")
    print(f"{'floor 3x (fwd read + bwd read + write)':<46} {floor_ms:8.2f}")
    if nominal:
        print(f"{'floor 3x at nominal bandwidth':<46} {3 * nbytes / (nominal * 1e12) * 1e3:8.2f}")
