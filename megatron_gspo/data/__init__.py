"""Prompt data: files (`.jsonl`, `.parquet`, save_to_disk directories) -> checked, templated, tokenised
`Prompt`s, served as a resumable, seeded stream (dataset.py); the demo tasks' files: single-digit sums
(arithmetic.py), two-digit sums worked column by column, the long-response task, and 1- to 4-digit ones for a
spread of response lengths (long_addition.py), and
products of 2-3 digit numbers with a calculator tool, the multi-turn task (multiplication.py)."""
from megatron_gspo.data.arithmetic import PAIRS, write_arithmetic_data
from megatron_gspo.data.dataset import PromptDataset, open_prompt_dataset
from megatron_gspo.data.errors import DataError
from megatron_gspo.data.long_addition import write_long_addition_data, write_long_addition_mixed_data
from megatron_gspo.data.multiplication import write_multiplication_data

__all__ = ["PAIRS", "DataError", "PromptDataset", "open_prompt_dataset", "write_arithmetic_data",
           "write_long_addition_data", "write_long_addition_mixed_data", "write_multiplication_data"]
