"""What the GPU tier needs, as skip reasons (None: present): CUDA, Transformer Engine, SGLang's CUDA build.

Each test module of tests/gpu/ marks itself with the reasons it depends on, so that on a CPU machine the
whole tier is collected and skipped, and on a GPU machine a missing piece says what it is and how to
provide it (scripts/gpu_check.sh sets up the environment these checks expect). The SGLang check runs
the interpreter of the SGLang environment once per session (a few seconds; only where CUDA is present).
"""
from __future__ import annotations

import functools
import subprocess
from pathlib import Path

import pytest
import torch

from megatron_gspo.rollout.sglang.server import SGLANG_PYTHON_ENV, default_sglang_python


def cuda_missing() -> str | None:
    if not torch.cuda.is_available():
        return f"needs a CUDA GPU (torch {torch.__version__} sees none)"
    return None


def gpus_missing(n: int) -> str | None:
    """A reason when fewer than n GPUs are visible."""
    missing = cuda_missing()
    if missing or torch.cuda.device_count() >= n:
        return missing
    return f"needs {n} GPUs, {torch.cuda.device_count()} visible"


@functools.cache
def te_missing() -> str | None:
    """Transformer Engine's PyTorch modules (pyproject.toml's `gpu` extra; the NGC container has them)."""
    if missing := cuda_missing():
        return missing
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # ImportError, or a build that does not match this torch / CUDA
        return f"Transformer Engine not importable ({type(e).__name__}: {str(e)[:200]})"
    return None


@functools.cache
def sglang_cuda_missing() -> str | None:
    """SGLang with its CUDA kernels, in the interpreter servers are started with (default_sglang_python)."""
    if missing := cuda_missing():
        return missing
    python = default_sglang_python()
    if not Path(python).exists():
        return f"no SGLang environment at {python} (set ${SGLANG_PYTHON_ENV} to one with SGLang's CUDA build)"
    probe = ("import torch, sglang, sgl_kernel; "
             "assert torch.cuda.is_available(), f'torch {torch.__version__} there sees no GPU'")
    try:
        proc = subprocess.run([python, "-c", probe], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=180)
    except subprocess.TimeoutExpired:
        return f"{python} -c 'import sglang, sgl_kernel' took over 180 s"
    if proc.returncode != 0:
        last = proc.stdout.strip().splitlines()[-1:] or ["(no output)"]
        return f"SGLang's CUDA build is not usable from {python}: {last[0][:200]}"
    return None


def skip_unless(*reasons: str | None) -> list[pytest.MarkDecorator]:
    """skipif marks for the given reasons (None entries: nothing missing)."""
    return [pytest.mark.skipif(reason is not None, reason=reason or "") for reason in reasons]
