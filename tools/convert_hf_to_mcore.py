#!/usr/bin/env python
"""Convert a Hugging Face Qwen3 / Qwen3-MoE checkpoint into a Megatron-Core torch_dist checkpoint.

    python tools/convert_hf_to_mcore.py --hf /models/Qwen3-30B-A3B --out /ckpt/qwen3-30b-a3b-mcore

Writes OUT/release/ and OUT/latest_checkpointed_iteration.txt; loads into any TP/EP/PP layout.
Streams tensor by tensor (megatron_gspo/convert/hf_to_mcore.py).
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_gspo.convert import convert_hf_to_mcore  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf", required=True, help="HF checkpoint directory (config.json + safetensors)")
    parser.add_argument("--out", required=True, help="output directory (must not exist)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args()
    try:
        shape = convert_hf_to_mcore(args.hf, args.out, progress=not args.no_progress)
    except (ValueError, OSError) as error:  # bad input: say what, without a traceback
        sys.exit(f"error: {error}")
    mlp = f"{shape.num_experts} experts" if shape.is_moe else "dense MLP"
    print(f"wrote {args.out} ({shape.num_layers} layers, {mlp})")


if __name__ == "__main__":
    main()
