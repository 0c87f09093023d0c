"""Prompt data: files (`.jsonl`, `.parquet`, save_to_disk directories) -> checked, templated, tokenised
`Prompt`s, served as a resumable, seeded stream (dataset.py); the arithmetic demo's files (arithmetic.py)."""
from megatron_gspo.data.arithmetic import PAIRS, write_arithmetic_data
from megatron_gspo.data.dataset import PromptDataset, open_prompt_dataset
from megatron_gspo.data.errors import DataError

__all__ = ["PAIRS", "DataError", "PromptDataset", "open_prompt_dataset", "write_arithmetic_data"]
