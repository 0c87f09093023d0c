"""GSPO for Megatron-Core."""
from megatron_gspo.platform.quiet import hide_fallback_warnings

__version__ = "0.1.0"
hide_fallback_warnings()  # Megatron-Core's six TE/apex import warnings: one line from the trainer instead
