"""Per-token log-probs (and entropy) of the sampled tokens from vocabulary-sharded logits.

Shapes: T tokens (all leading dims flattened), V vocab shard (this rank's columns), c tokens in a chunk.

Rank r of `tp_group` holds global vocab ids [r*V, (r+1)*V) (Megatron's ColumnParallelLinear layout).
Global ids >= `vocab_size` are padding (Megatron pads the vocab to a multiple of 128*TP) and take no
part in the softmax. Logits are divided by the sampling temperature first, as SGLang's sampler does,
so that train and rollout log-probs describe the same (tempered) distribution.

Math, per token, over the valid ids j of all shards: x = logits / temperature, t the target,
M = max_j x_j, Z = sum_j exp(x_j - M), p_j = exp(x_j - M) / Z.
  (1) log p_t = (x_t - M) - log Z
  (2) H = -sum_j p_j log p_j = log Z - sum_j p_j (x_j - M)
  (3) d log p_t / d x_j = onehot_j(t) - p_j
  (4) d H / d x_j = -p_j (log p_j + H),  log p_j + H = (x_j - M) + (H - log Z)
  and d x / d logits = 1 / temperature.
Each shard sums relative to its own max m: s1 = sum exp(x - m), s2 = sum exp(x - m) (x - m). Then
  (5) sum exp(x - M) = exp(m - M) s1,  sum exp(x - M) (x - M) = exp(m - M) (s2 + (m - M) s1),
so one max all-reduce (M) and one sum all-reduce (of both rescaled sums and the target logit) give
(1) and (2) for all chunks together.

Memory: forward and backward walk over the tokens in chunks, with one or two float32 working buffers
of `c x V` reused by every chunk. Only per-token statistics (global max, log Z, entropy) are saved;
the logits are saved as they are (autograd holds them anyway) and the backward recomputes the
softmax from them, writing the gradient straight into its output (in the logits' dtype).
Collectives: the two all-reduces of (5) per call, whatever the chunking; the backward needs none: the
shard's softmax against the saved global statistics is already exact.

In place (`inplace=True`): the logits buffer is overwritten and becomes the gradient buffer, as in
Megatron-Core's vocab_parallel_cross_entropy. With float32 logits the forward keeps the shard's
exp(x - m) in the logits themselves, or x - m when the entropy is asked for, and the backward turns
that into the gradient where it lies: no c x V copy, no gradient allocation, and no exp in the
backward of the log-prob alone. Other dtypes keep the forward as it is and write the gradient
(rounded once to their dtype) into the logits in the backward.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# Default chunk, in bytes of float32 working copy. On CPU a chunk that stays in cache is fastest
# (measured at V=151936: 4 MB beats 256 MB by ~1.5x); on GPU large chunks keep the kernels large.
_CHUNK_BYTES = {"cpu": 4 << 20}
_CHUNK_BYTES_DEFAULT = 256 << 20

# What the saved logits buffer holds after the forward, per shard column (x = logits / temperature,
# m = the shard's max): the logits as given, or (inplace=True, float32) x - m or exp(x - m).
_LOGITS, _SHIFTED, _EXP = "logits", "x - m", "exp(x - m)"


def vocab_parallel_logprobs(logits, targets, *, tp_group=None, temperature=1.0, vocab_size=None,
                            chunk_size=None, with_entropy=False, inplace=False):
    """log pi(target | .) per token, float32, from this rank's vocabulary shard of the logits: eq. (1).

    logits: [..., V] any float dtype, this rank's contiguous vocabulary shard.
    targets: [...] integer global vocab ids. An id outside [0, vocab_size) (e.g. an ignore index on
        a masked position) yields a finite, meaningless value and no gradient through its one-hot
        term: mask such positions in the loss.
    tp_group: the tensor-parallel group the vocab is sharded over; None means unsharded.
    temperature: the logits are divided by it before the softmax.
    vocab_size: the true vocabulary size; ids >= vocab_size are padding. None: no padding.
    chunk_size: tokens per chunk; None: 4 MB of float32 per chunk on CPU, 256 MB on GPU;
        0 means one chunk.
    with_entropy: also return the entropy (2) of the whole (tempered, unpadded) distribution per
        token. The log-probs are the same bit for bit either way.
    inplace: the logits buffer is overwritten and becomes the gradient buffer (returned as the
        gradient, in the logits' dtype). Pass it only when nothing else reads the logits after this
        call: true for the training loss on the output layer's logits, whose backward needs only its
        input and weight. With float32 logits the forward already overwrites them (with the shard's
        softmax numerators); other dtypes are overwritten in the backward. Autograd sees the logits as
        modified by this call, so another op that saved them for its backward raises there rather
        than use the overwritten values; but a read of the logits after this call (which sees the
        overwritten values) is not detected. A leaf that requires grad cannot be modified in place
        and is refused; a non-contiguous tensor is first copied (correct, saves nothing). Values are
        those of inplace=False bit for bit; the gradient agrees to float32 rounding (~1e-7 relative).

    Returns logprobs [...] float32, or (logprobs, entropy) with with_entropy. Differentiable with
    respect to `logits` (through both outputs at once).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
    tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
    V = logits.shape[-1]
    if vocab_size is None:
        vocab_size = V * tp_size
    if not 0 < vocab_size <= V * tp_size:
        raise ValueError(f"vocab_size {vocab_size} not in (0, {V * tp_size}] (= {tp_size} shards of {V})")
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets shape {tuple(targets.shape)} != logits' leading shape "
                         f"{tuple(logits.shape[:-1])}")
    if inplace:
        if torch.is_grad_enabled() and logits.requires_grad and (
                logits.is_leaf or (logits._base is not None and logits._base.is_leaf)):
            raise ValueError("inplace=True overwrites the logits: they must not be a leaf (or a view "
                             "of a leaf) that requires grad; pass the output of the layer that made them")
        if not logits.is_contiguous():
            logits = logits.contiguous()  # a copy to overwrite: correct, but saves nothing

    lead_shape = targets.shape
    # Padding ids are a suffix of the vocabulary, so on each shard they are a suffix of columns.
    vocab_start = tp_rank * V
    n_valid = min(max(vocab_size - vocab_start, 0), V)
    T = targets.numel()
    chunk = _chunk_tokens(chunk_size, T, n_valid, logits.device)
    logprobs_T, entropy_T = _VocabParallelLogprobs.apply(
        logits.reshape(T, V), targets.reshape(T), tp_group if tp_size > 1 else None,
        float(temperature), vocab_start, n_valid, chunk, with_entropy, inplace)
    if with_entropy:
        return logprobs_T.view(lead_shape), entropy_T.view(lead_shape)
    return logprobs_T.view(lead_shape)


def _chunk_tokens(chunk_size, T, n_valid, device):
    if chunk_size is None:
        chunk_bytes = _CHUNK_BYTES.get(device.type, _CHUNK_BYTES_DEFAULT)
        return max(1, chunk_bytes // (4 * max(n_valid, 1)))
    if chunk_size < 0:
        raise ValueError(f"chunk_size must be >= 0, got {chunk_size}")
    return chunk_size if 0 < chunk_size < T else max(T, 1)


class _VocabParallelLogprobs(torch.autograd.Function):
    """Log-probs (1) and entropy (2) in one chunked pass over the shard; gradient (3)-(4) in another.

    With inplace=True the forward may overwrite the logits (float32) and the backward returns them
    as the gradient, the way Megatron-Core's _VocabParallelCrossEntropy does, without mark_dirty:
    autograd lets a Function that marks a view dirty (the logits often are one) return only that
    view, and this one returns log-probs and entropy. The in-place writes still bump the logits'
    version counter, which is what makes another op that saved them raise in its backward; a forward
    that leaves them as they are for now (other dtypes) bumps it by hand for the same effect.
    """

    @staticmethod
    def forward(ctx, logits_TV, targets_T, tp_group, temperature, vocab_start, n_valid, chunk,
                with_entropy, inplace):
        T = targets_T.numel()
        dev = logits_TV.device
        overwrite = inplace and logits_TV.dtype == torch.float32  # x lives in the logits themselves
        idx_T = targets_T.long() - vocab_start
        here_T = (idx_T >= 0) & (idx_T < n_valid)  # the target is on this shard
        idx_T = idx_T.clamp(0, max(n_valid - 1, 0))  # its column here (a valid one when elsewhere)

        # Statistics relative to the shard's own max m, rescaled to the global max M afterwards (5).
        max_T = torch.full((T,), float("-inf"), device=dev)
        sums_3T = torch.zeros(3, T, device=dev)  # rows: s1, s2 (entropy only), target logit
        if n_valid > 0:
            # The target logit first: the loop may overwrite it.
            sums_3T[2] = torch.where(here_T, logits_TV.gather(1, idx_T[:, None]).squeeze(1).float()
                                     / temperature, 0.0)
            # Working buffers are allocated once and reused by every chunk: fresh large allocations
            # cost page faults on CPU and allocator churn on GPU.
            c = min(chunk, T)
            x_buf = None if overwrite else torch.empty(c, n_valid, device=dev)
            e_buf = torch.empty(c, n_valid, device=dev) if with_entropy else None
            for lo in range(0, T, chunk):
                hi = min(lo + chunk, T)
                x_cV = _tempered(logits_TV[lo:hi, :n_valid], temperature,
                                 out=None if overwrite else x_buf[:hi - lo])
                m_c = x_cV.amax(dim=1)
                max_T[lo:hi] = m_c
                x_cV.sub_(m_c[:, None])
                if with_entropy:  # overwrite: x - m stays in the logits
                    e_cV = torch.exp(x_cV, out=e_buf[:hi - lo])
                    sums_3T[0, lo:hi] = e_cV.sum(dim=1)
                    # e * (x - m) in place, then torch's sum: its cascade summation keeps ~1e-7
                    # relative error over 1e5 terms, where a BLAS dot product (bmm) lost 2e-4.
                    sums_3T[1, lo:hi] = e_cV.mul_(x_cV).sum(dim=1)
                else:  # overwrite: exp(x - m) stays in the logits
                    sums_3T[0, lo:hi] = x_cV.exp_().sum(dim=1)
            del x_buf, e_buf
        if inplace and not overwrite:
            torch.autograd.graph.increment_version(logits_TV)  # see the class docstring

        gmax_T, shift_T, log_z_T, logprobs_T, entropy_T = _global_stats(
            max_T, sums_3T, tp_group, n_valid, with_entropy)

        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits_TV, idx_T, here_T, gmax_T, shift_T, log_z_T, entropy_T)
        held = _LOGITS if not overwrite or n_valid == 0 else _SHIFTED if with_entropy else _EXP
        ctx.cfg = (temperature, n_valid, chunk, inplace, held)
        return logprobs_T, entropy_T

    @staticmethod
    def backward(ctx, grad_logprobs_T, grad_entropy_T):
        buf_TV, idx_T, here_T, gmax_T, shift_T, log_z_T, entropy_T = ctx.saved_tensors
        temperature, n_valid, chunk, inplace, held = ctx.cfg
        nones = (None,) * 8
        grad_TV = buf_TV if inplace else torch.empty_like(buf_TV)
        if n_valid == 0 or (grad_logprobs_T is None and grad_entropy_T is None):
            return grad_TV.zero_(), *nones
        T = gmax_T.numel()
        c = min(chunk, T)
        grad_TV[:, n_valid:] = 0  # padded columns take no part in the softmax: zero gradient
        grad = _ChunkGrad(held, idx_T, here_T, shift_T, log_z_T, entropy_T, grad_logprobs_T,
                          grad_entropy_T, temperature, c, n_valid, buf_TV.device)
        # Recomputing from the logits works in the gradient itself when it is float32 (each chunk
        # is read before it is written, also when the gradient is the logits), else in one buffer.
        work_buf = None
        if held == _LOGITS and grad_TV.dtype != torch.float32:
            work_buf = torch.empty(c, n_valid, device=buf_TV.device)
        for lo in range(0, T, chunk):
            hi = min(lo + chunk, T)
            out_cV = grad_TV[lo:hi, :n_valid]
            if held == _EXP:
                coef_cV = grad(out_cV, lo, hi)
            elif held == _SHIFTED:  # (x - M) = (x - m) + (m - M)
                coef_cV = grad(out_cV.add_(shift_T[lo:hi, None]), lo, hi)
            else:  # the shard's softmax against the saved global max and sum: purely local
                x_cV = _tempered(buf_TV[lo:hi, :n_valid], temperature,
                                 out=out_cV if work_buf is None else work_buf[:hi - lo])
                coef_cV = grad(x_cV.sub_(gmax_T[lo:hi, None]), lo, hi)
                if work_buf is not None:
                    out_cV.copy_(coef_cV)
        return grad_TV, *nones


def _global_stats(max_T, sums_3T, tp_group, n_valid, with_entropy):
    """Per-token statistics of the whole vocabulary from each shard's, relative to its own max m.

    sums_3T rows: s1, s2 of (5), target logit (0 off its shard); rescaled in place. Returns the
    global max M, m - M, log Z, the log-probs (1) and the entropy (2) (or None).
    """
    gmax_T = max_T.clone()
    if tp_group is not None:
        dist.all_reduce(gmax_T, op=dist.ReduceOp.MAX, group=tp_group)
    if n_valid == 0:
        max_T = gmax_T  # all-padding shard: its sums are 0, any finite shift keeps them 0
    shift_T = max_T - gmax_T
    scale_T = torch.exp(shift_T)
    sums_3T[1] = scale_T * (sums_3T[1] + sums_3T[0] * shift_T)  # (5)
    sums_3T[0] *= scale_T
    if tp_group is not None:
        dist.all_reduce(sums_3T, group=tp_group)
    sumexp_T, shifted_dot_T, target_T = sums_3T
    log_z_T = torch.log(sumexp_T)
    # (x_t - M) - log Z rather than x_t - (M + log Z): exact for the likely tokens even when
    # the logits are large (fp32 spacing at 1e4 is 1e-3).
    logprobs_T = (target_T - gmax_T) - log_z_T
    entropy_T = log_z_T - shifted_dot_T / sumexp_T if with_entropy else None
    return gmax_T, shift_T, log_z_T, logprobs_T, entropy_T


class _ChunkGrad:
    """d(loss)/d(logits) of one chunk, written over what the buffer holds of it (float32).

    By (3) and (4): -p (g_lp + g_H (log p + H)) / temp + g_lp onehot / temp, with g_lp, g_H the
    upstream gradients. The chunk comes as x - M, p = exp(x - M) / Z; or, when the forward left
    exp(x - m) in the logits (inplace, log-prob alone), as e = exp(x - m), p = e exp((m - M) - log Z):
    one multiply, no exp. The per-token factors are computed once here, applied chunk by chunk.
    """

    def __init__(self, held, idx_T, here_T, shift_T, log_z_T, entropy_T, grad_logprobs_T,
                 grad_entropy_T, temperature, chunk, n_valid, device):
        self.from_exp = held == _EXP
        self.idx_T, self.grad_logprobs_T, self.grad_entropy_T = idx_T, grad_logprobs_T, grad_entropy_T
        self.neg_p_scale_T = torch.exp(-log_z_T) * (-1.0 / temperature)  # 1/Z <= 1: the max adds exp(0)
        if grad_logprobs_T is not None:
            self.onehot_T = torch.where(here_T, grad_logprobs_T / temperature, 0.0)
        if self.from_exp:  # no entropy output, so g_H is None
            self.lp_scale_T = torch.exp(shift_T - log_z_T) * (grad_logprobs_T * (-1.0 / temperature))
        elif grad_entropy_T is None:
            self.lp_scale_T = grad_logprobs_T * self.neg_p_scale_T
        else:
            self.h_shift_T = entropy_T - log_z_T
            self.e_buf = torch.empty(chunk, n_valid, device=device)

    def __call__(self, x_cV, lo, hi):
        """x_cV: x - M (or exp(x - m)) of tokens lo:hi, overwritten; returns it holding the gradient."""
        if self.grad_entropy_T is None:
            coef_cV = (x_cV if self.from_exp else x_cV.exp_()).mul_(self.lp_scale_T[lo:hi, None])
        else:
            e_cV = torch.exp(x_cV, out=self.e_buf[:hi - lo])
            coef_cV = x_cV.add_(self.h_shift_T[lo:hi, None]).mul_(self.grad_entropy_T[lo:hi, None])
            if self.grad_logprobs_T is not None:
                coef_cV.add_(self.grad_logprobs_T[lo:hi, None])
            coef_cV.mul_(e_cV).mul_(self.neg_p_scale_T[lo:hi, None])
        if self.grad_logprobs_T is not None:
            coef_cV.scatter_add_(1, self.idx_T[lo:hi, None], self.onehot_T[lo:hi, None])
        return coef_cV


def _tempered(src_cV, temperature, out=None):
    """out <- float32(src) / temperature (out=None: src in place, float32); returns out."""
    out = src_cV if out is None else out.copy_(src_cV)
    if temperature != 1.0:
        out.div_(temperature)
    return out
