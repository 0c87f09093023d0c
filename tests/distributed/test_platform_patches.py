"""Every CPU platform patch is needed (its probe fails without it) and sufficient (passes with it)."""
import pytest

from megatron_gspo.parallel.launch import torchrun


@pytest.mark.distributed
def test_each_cpu_patch_is_needed_and_works():
    out = torchrun("tests/distributed/workers/platform_patches.py", 2, timeout=300)
    assert out.count("OK platform patches rank") == 2
