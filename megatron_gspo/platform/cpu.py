"""What Megatron-Core 0.16.1 needs to run on a CPU-only torch build with the gloo backend.

Every workaround lives here, in one registry, each citing the upstream file:line it works around
(paths relative to `megatron/core/`, megatron-core 0.16.1). `apply_cpu_patches()` applies them only
when CUDA is absent (GPU clusters run stock Megatron-Core) and is idempotent; every patch can be
reverted, which is how `tests/distributed/workers/platform_patches.py` proves that each one is needed:
with the patch removed its probe fails, with it applied the probe passes.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

Undo = Callable[[], None]


@dataclass(frozen=True)
class Patch:
    name: str
    upstream: str
    """Where in megatron-core 0.16.1 the CUDA-only code lives (file:line under megatron/core/)."""
    install: Callable[[], list[Undo]]
    """Applies the patch and returns the undo actions, run in reverse order to revert it."""


def _swap(owner: Any, attr: str, new: Any) -> Undo:
    """Set owner.attr = new; return the action that puts the original back."""
    had = attr in vars(owner) if isinstance(owner, type) else hasattr(owner, attr)
    old = vars(owner).get(attr) if isinstance(owner, type) else getattr(owner, attr, None)

    def undo() -> None:
        if had:
            setattr(owner, attr, old)
        else:
            delattr(owner, attr)

    setattr(owner, attr, new)
    return undo


class CudaLiteralsToCpu(TorchFunctionMode):
    """Inside this mode, torch calls that name a CUDA device run on the CPU instead.

    Megatron hard-codes `device="cuda"`, `.cuda()` and `pin_memory=True` in code paths that have no
    device argument (schedules, optimizer, grad-norm). Rewriting them at the torch-function level keeps
    the patch to "run this upstream function under the mode" instead of copying upstream functions.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and not isinstance(device, int) and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # clip_grads.py:167 and distrib_optimizer.py:420 assert the grad type is
            # 'torch.cuda.FloatTensor': report CPU tensors under their CUDA type name.
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], (str, torch.device)) \
                and torch.device(args[1]).type == "cuda":
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _run_on_cpu(owner: Any, attr: str) -> Undo:
    """Replace owner.attr (a function) by one that runs under CudaLiteralsToCpu."""
    fn = getattr(owner, attr)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with CudaLiteralsToCpu():
            return fn(*args, **kwargs)

    return _swap(owner, attr, wrapper)


def _run_without_cpu_mode(owner: Any, attr: str) -> Undo:
    """Replace owner.attr by one that leaves an enclosing CudaLiteralsToCpu mode while it runs.

    A torch-function mode costs a Python call on every torch op under it. The schedules need the mode
    for three allocations only; the forward and backward steps they call (hundreds of ops per
    micro-batch, none naming CUDA) run faster without it.
    """
    fn = getattr(owner, attr)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not isinstance(torch.overrides._get_current_function_mode(), CudaLiteralsToCpu):
            return fn(*args, **kwargs)
        with torch.overrides._pop_mode_temporarily():
            return fn(*args, **kwargs)

    return _swap(owner, attr, wrapper)


class _DropMessage(logging.Filter):
    def __init__(self, message: str):
        super().__init__()
        self.message = message

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != self.message


class _NoOpStream:
    """Stands in for torch.cuda.Stream / Event: ordering is trivial on one CPU stream."""

    def __init__(self, *args, **kwargs): pass
    def wait_stream(self, *args, **kwargs): pass
    def wait_event(self, *args, **kwargs): pass
    def record_event(self, *args, **kwargs): return _NoOpStream()
    def record(self, *args, **kwargs): pass
    def wait(self, *args, **kwargs): pass
    def synchronize(self): pass
    def query(self): return True
    def elapsed_time(self, *args): return 0.0


# ----------------------------------------------------------------------------------------------------
# The patches. Each install function returns its undo actions.

def _current_device() -> list[Undo]:
    # ~60 allocations do `device=torch.cuda.current_device()`, the first one reached being
    # models/common/embeddings/rotary_pos_embedding.py:162; a CPU build raises "Torch not compiled
    # with CUDA enabled" there.
    return [_swap(torch.cuda, "current_device", lambda: torch.device("cpu"))]


def _streams() -> list[Undo]:
    # transformer/moe/token_dispatcher.py:445 creates torch.cuda.Stream() in the all-to-all
    # dispatcher; :871-874 use current_stream()/stream(); the schedules call synchronize().
    return [
        _swap(torch.cuda, "Stream", _NoOpStream),
        _swap(torch.cuda, "Event", _NoOpStream),
        _swap(torch.cuda, "current_stream", lambda *a, **k: _NoOpStream()),
        _swap(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext()),
        _swap(torch.cuda, "synchronize", lambda *a, **k: None),
    ]


def _causal_mask() -> list[Undo]:
    # transformer/utils.py:35 and :40 build the default causal / sliding-window masks with
    # device="cuda"; fusions/fused_softmax.py imports them for attention_mask=None.
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.utils as transformer_utils

    @functools.lru_cache(maxsize=32)
    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    def get_sliding_window_causal_mask(sq, skv, window_size):
        upper = torch.triu(torch.ones(sq, skv, dtype=torch.bool), diagonal=skv - sq - window_size[0])
        return ~torch.tril(upper, diagonal=skv - sq + window_size[1])

    undo = []
    for module in (fused_softmax, transformer_utils):
        undo.append(_swap(module, "get_default_causal_mask", get_default_causal_mask))
        if hasattr(module, "get_sliding_window_causal_mask"):
            undo.append(_swap(module, "get_sliding_window_causal_mask", get_sliding_window_causal_mask))
    return undo


def _rng_tracker() -> list[Undo]:
    # tensor_parallel/random.py:235-238 (CudaRNGStatesTracker.add) and :41/:72 (_get/_set_cuda_rng_state)
    # keep *CUDA* generator states; attention forks the tracker on every forward. Back the tracker by
    # CPU generator states: same semantics (a named stream per model-parallel region).
    import megatron.core.tensor_parallel.random as random

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    # With both streams on the CPU generator, fork() (random.py:264) warns on every forward that the
    # "CPU RNG state changed within GPU RNG context": true by construction here, so silence it.
    logger = logging.getLogger(random.__name__)
    quiet = _DropMessage("CPU RNG state changed within GPU RNG context")
    logger.addFilter(quiet)
    return [
        lambda: logger.removeFilter(quiet),
        _swap(random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state()),
        _swap(random, "_set_cuda_rng_state", lambda new_state, *a, **k: torch.set_rng_state(new_state)),
        _swap(random.CudaRNGStatesTracker, "add", add),
    ]


def _moe_router_gemm() -> list[Undo]:
    # transformer/moe/moe_utils.py:1192 tests `te_general_gemm is not None`, but the name is only
    # bound when Transformer Engine imports (:22-39): NameError on every router forward without TE
    # (fixed upstream in 0.17). Binding it to None selects the plain-torch path.
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return []
    return [_swap(moe_utils, "te_general_gemm", None)]


def _norm_sequence_parallel() -> list[Undo]:
    # MoE with TP>1 requires sequence parallelism (transformer/moe/moe_layer.py:379), which the only
    # non-TE norm refuses (transformer/torch_norm.py:32). Norms act per token, so they are correct
    # under SP; their weight gradients need a TP all-reduce, which distributed/finalize_model_grads.py
    # does for parameters tagged `sequence_parallel=True`.
    from megatron.core.transformer import torch_norm

    def new(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False,
            zero_centered_gamma=False, normalization="LayerNorm"):
        if config.layernorm_zero_centered_gamma or config.memory_efficient_layer_norm:
            raise ValueError("torch norms support neither zero-centered gamma nor memory-efficient norm")
        norm_cls = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}[config.normalization]
        norm = norm_cls(normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm

    return [_swap(torch_norm.WrappedTorchNorm, "__new__", staticmethod(new))]


def _alltoall_splits() -> list[Undo]:
    # The all-to-all dispatcher turns split sizes into numpy via moe_utils.maybe_move_tensor_to_cpu
    # (moe_utils.py:1078-1100), which only converts *CUDA* tensors; on CPU the splits stay tensors and
    # all_to_all_single (tensor_parallel/mappings.py:444) raises TypeError.
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.cpu().numpy()
        return tensor

    return [_swap(token_dispatcher, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)]


def _schedules() -> list[Undo]:
    # pipeline_parallel/schedules.py:596, :983, :2138 allocate `total_num_tokens` with device="cuda"
    # in every schedule (no pipelining, interleaved, 1F1B). The per-micro-batch forward_step and
    # backward_step (schedules.py:311, :446), which the schedules call by their module-level names,
    # name no CUDA device and run outside the mode.
    import megatron.core.pipeline_parallel.schedules as schedules

    undo = [_run_on_cpu(schedules, name) for name in (
        "forward_backward_no_pipelining",
        "forward_backward_pipelining_with_interleaving",
        "forward_backward_pipelining_without_interleaving",
    )]
    return undo + [_run_without_cpu_mode(schedules, name) for name in ("forward_step", "backward_step")]


def _optimizer() -> list[Undo]:
    # optimizer/optimizer.py:907 (FP32Optimizer.__init__) and :473-485 (MixedPrecisionOptimizer),
    # optimizer/clip_grads.py:90/:103/:115/:167/:174/:207 (grad norm, count-zeros, type asserts),
    # optimizer/distrib_optimizer.py:420 use device="cuda" or assert CUDA tensor types.
    from megatron.core.optimizer import distrib_optimizer, optimizer

    classes = (optimizer.MegatronOptimizer, optimizer.MixedPrecisionOptimizer,
               optimizer.Float16OptimizerWithFloat16Params, optimizer.FP32Optimizer,
               optimizer.ChainedOptimizer, distrib_optimizer.DistributedOptimizer)
    methods = ("__init__", "step", "prepare_grads", "step_with_ready_grads", "get_grad_norm",
               "clip_grad_norm", "count_zeros", "load_state_dict", "state_dict", "sharded_state_dict",
               "load_parameter_state_from_dp_zero", "get_parameter_state_dp_zero")
    return [_run_on_cpu(cls, name) for cls in classes for name in methods if name in vars(cls)]


def _cp_rotary_slice() -> list[Undo]:
    # models/common/embeddings/rope_utils.py:62-64 builds the CP chunk index with pin_memory=True and
    # .cuda(): every GPTModel forward at cp > 1 outside a schedule (whose patch covers it) fails.
    # rotary_pos_embedding.py:26 and yarn_rotary_pos_embedding.py:13 import the function by name.
    from megatron.core.models.common.embeddings import (rope_utils, rotary_pos_embedding,
                                                        yarn_rotary_pos_embedding)

    return [_run_on_cpu(module, "get_pos_emb_on_this_cp_rank")
            for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding)]


def _tied_embeddings_pp() -> list[Undo]:
    # models/common/language_module/language_module.py:244: with tied embeddings and PP > 1 the
    # first and last stages sync their copies with `weight.data = weight.data.cuda()` + all-reduce.
    from megatron.core.models.common.language_module.language_module import LanguageModule

    return [_run_on_cpu(LanguageModule, "setup_embeddings_and_output_layer")]


def _grad_norm_float64() -> list[Undo]:
    # Without apex/TE the grad norm is optimizer/clip_grads.py:l2_norm_impl ->
    # utils.local_multi_tensor_l2_norm (utils.py:1205), a float32 torch.norm per tensor. torch 2.13's
    # CPU float32 norm loses ~1e-5..3e-4 relative precision on 1-4M-element tensors, so grad norms and
    # clipping differ between layouts that shard the same tensor differently. Sum squares in float64.
    import megatron.core.optimizer.clip_grads as clip_grads

    def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
        squares = [t.double().square().sum() for tensors in tensor_lists for t in tensors]
        total = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64)
        return total.sqrt().float().reshape(1), None

    return [_swap(clip_grads, "l2_norm_impl", l2_norm)]


PATCHES: tuple[Patch, ...] = (
    Patch("current_device", "models/common/embeddings/rotary_pos_embedding.py:162 (+~60 sites)", _current_device),
    Patch("streams", "transformer/moe/token_dispatcher.py:445", _streams),
    Patch("causal_mask", "transformer/utils.py:35", _causal_mask),
    Patch("rng_tracker", "tensor_parallel/random.py:235", _rng_tracker),
    Patch("moe_router_gemm", "transformer/moe/moe_utils.py:1192", _moe_router_gemm),
    Patch("norm_sequence_parallel", "transformer/torch_norm.py:32", _norm_sequence_parallel),
    Patch("alltoall_splits", "transformer/moe/moe_utils.py:1093", _alltoall_splits),
    Patch("schedules", "pipeline_parallel/schedules.py:596", _schedules),
    Patch("optimizer", "optimizer/optimizer.py:907", _optimizer),
    Patch("cp_rotary_slice", "models/common/embeddings/rope_utils.py:62", _cp_rotary_slice),
    Patch("tied_embeddings_pp", "models/common/language_module/language_module.py:244", _tied_embeddings_pp),
    Patch("grad_norm_float64", "optimizer/clip_grads.py:l2_norm_impl (utils.py:1205)", _grad_norm_float64),
)

_applied: dict[str, list[Undo]] = {}


def cpu_patches_needed() -> bool:
    return not torch.cuda.is_available()


def apply_cpu_patches(names: tuple[str, ...] | None = None, *, force: bool = False) -> list[str]:
    """Apply the named patches (default: all) when CUDA is absent; return the names now applied.

    Idempotent. `force=True` applies them even where CUDA exists (tests only).
    """
    if not (force or cpu_patches_needed()):
        return []
    known = {p.name: p for p in PATCHES}
    for name in names or known:
        if name not in known:
            raise ValueError(f"unknown CPU patch {name!r}; known: {sorted(known)}")
        if name not in _applied:
            _applied[name] = known[name].install()
    return list(_applied)


def revert_cpu_patches(names: tuple[str, ...] | None = None) -> None:
    """Undo the named patches (default: all applied ones)."""
    for name in list(names or _applied):
        for undo in reversed(_applied.pop(name, [])):
            undo()


def applied_cpu_patches() -> list[str]:
    return list(_applied)
