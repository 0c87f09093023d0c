#!/usr/bin/env python
"""Convert a Megatron-Core torch_dist checkpoint of Qwen3 / Qwen3-MoE into Hugging Face safetensors.

    python tools/convert_mcore_to_hf.py --mcore /ckpt/run/iter_0000500 --hf-config /models/Qwen3-30B-A3B \\
        --out /models/Qwen3-30B-A3B-gspo

--mcore is a checkpoint directory (with .metadata) or a Megatron checkpoint root (with
latest_checkpointed_iteration.txt), saved at any parallel layout. --hf-config gives the model's
shape; its config, tokenizer and generation files are copied verbatim. Streams tensor by tensor
(megatron_gspo/convert/mcore_to_hf.py).
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_gspo.convert import convert_mcore_to_hf  # noqa: E402
from megatron_gspo.convert.mcore_to_hf import DEFAULT_SHARD_BYTES  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mcore", required=True, help="Megatron checkpoint (directory or root)")
    parser.add_argument("--hf-config", required=True, help="HF directory with config.json and tokenizer files")
    parser.add_argument("--out", required=True, help="output directory (must not exist)")
    parser.add_argument("--max-shard-gb", type=float, default=DEFAULT_SHARD_BYTES / 1e9,
                        help="largest safetensors shard, in GB (default %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args()
    try:
        convert_mcore_to_hf(args.mcore, args.hf_config, args.out, max_shard_bytes=int(args.max_shard_gb * 1e9),
                            progress=not args.no_progress)
    except (ValueError, OSError) as error:  # bad input: say what, without a traceback
        sys.exit(f"error: {error}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
