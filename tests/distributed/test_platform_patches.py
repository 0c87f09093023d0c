"""Every CPU platform patch is needed (its probe fails without it) and sufficient (passes with it)."""
from pathlib import Path

import pytest

from devtools.torchrun import run_checks
from megatron_gspo.platform.cpu import PATCHES

WORKER = Path(__file__).parent / "workers" / "platform_patches.py"


@pytest.mark.distributed
def test_each_cpu_patch_is_needed_and_works():
    # "every patch has a probe", one check per patch, then forward/backward steps outside the mode
    run_checks(WORKER, 2, checks=1 + len(PATCHES) + 1, timeout=300)
