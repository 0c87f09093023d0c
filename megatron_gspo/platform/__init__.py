"""Platform glue: what Megatron-Core needs on machines without CUDA (see cpu.py)."""
from megatron_gspo.platform.cpu import apply_cpu_patches, cpu_patches_needed, revert_cpu_patches

__all__ = ["apply_cpu_patches", "cpu_patches_needed", "revert_cpu_patches"]
