#!/usr/bin/env python
"""Compare per-token log-probs of a Hugging Face checkpoint (transformers) and a Megatron checkpoint.

    python tools/check_hf_mcore_parity.py --hf /models/Qwen3-30B-A3B --mcore /ckpt/qwen3-mcore --tp 2 --ep 2

Launches itself under torchrun with tp*pp*ep processes (or runs as one rank of an existing launch)
and prints max / mean |log-prob difference| and argmax agreement; exits 1 above --threshold.
Both models score the same random token ids in float32; transformers runs on rank 0 only.
"""
import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist  # noqa: E402

from megatron_gspo.config import ParallelConfig  # noqa: E402
from megatron_gspo.convert.parity import check_parity  # noqa: E402
from megatron_gspo.net import free_port  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf", required=True, help="HF checkpoint directory")
    parser.add_argument("--mcore", required=True, help="Megatron checkpoint (directory or root)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--threshold", type=float, default=1e-4, help="largest allowed |log-prob diff|")
    args = parser.parse_args()

    if "RANK" not in os.environ:  # not under torchrun: become a torchrun of tp*pp*ep ranks running this file
        os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                                  str(args.tp * args.pp * args.ep), "--master-addr", "127.0.0.1",
                                  "--master-port", str(free_port()), __file__, *sys.argv[1:]])

    layout = ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep, dp=args.ep)
    report = check_parity(args.hf, args.mcore, layout, batch=args.batch, seq_len=args.seq_len)
    failed = report is not None and not report.max_abs_diff <= args.threshold
    if report is not None:
        print(f"parity {layout}: {report}")
        print(f"FAIL: max diff above {args.threshold}" if failed else f"OK: within {args.threshold}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
