"""Benchmark: streaming HF <-> Megatron conversion vs a plain file copy, and its peak memory.

A synthetic Qwen3-MoE checkpoint with Qwen3-30B-A3B widths (hidden 2048, 32 heads, 4 KV heads,
head_dim 128, 128 experts of width 768, vocab 151936, bf16) is written straight in safetensors
format (5 GB shards + index, no transformers), at 2 and 4 layers. For each depth, side by side:
  hf->mcore convert_hf_to_mcore (torch_dist, fsynced), against a copy of the HF files
  mcore->hf convert_mcore_to_hf (5 GB shards, fsynced), against a copy of the torch_dist files
A copy is shutil.copyfile + fsync of each file into a new directory on the same disk, made just
before the conversion it is compared with; each pair runs --reps times. "x copy" is each pair's
ratio (copy seconds / conversion seconds), the median over the pairs with their range: on a
shared machine the disk's speed drifts by several x within minutes, so only a pair's two runs,
adjacent in time, are comparable.
Each conversion runs in a fresh subprocess that reports its own peak RSS (VmHWM) and its RSS
after imports; "x layer" is (highest peak - after-imports) / the bytes of the largest layer (one
transformer layer, or embedding + output layer, whichever is larger). The input files are in the
page cache for the copy as for the conversion (just written or read), or, with --cold, dropped
from it (posix_fadvise DONTNEED) before each. Then projections for Qwen3-30B-A3B (48 layers) and
Qwen3-235B-A22B (94 layers) at the median throughput.

    python benchmarks/convert.py                  # 2 and 4 layers, ~13 GB of disk at the peak
    python benchmarks/convert.py --layers 1 --experts 16   # smoke size
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


@dataclass(frozen=True)
class Widths:
    hidden: int = 2048
    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    experts: int = 128
    expert_ffn: int = 768
    vocab: int = 151936

    def layer_bytes(self) -> int:
        H, D = self.hidden, self.head_dim
        attention = (self.heads * D + 2 * self.kv_heads * D) * H + H * self.heads * D + 2 * D + 2 * H
        return 2 * (attention + self.experts * H + self.experts * 3 * self.expert_ffn * H)

    def model_bytes(self, layers: int) -> int:
        return 2 * (2 * self.vocab * self.hidden + self.hidden) + layers * self.layer_bytes()


QWEN3_30B = Widths()
QWEN3_235B = Widths(hidden=4096, heads=64, kv_heads=4, head_dim=128, experts=128, expert_ffn=1536)


def config(w: Widths, layers: int) -> dict:
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": w.vocab,
            "hidden_size": w.hidden, "intermediate_size": 6144, "num_hidden_layers": layers,
            "num_attention_heads": w.heads, "num_key_value_heads": w.kv_heads, "head_dim": w.head_dim,
            "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "tie_word_embeddings": False, "attention_bias": False, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "moe_intermediate_size": w.expert_ffn, "num_experts": w.experts,
            "num_experts_per_tok": 8, "norm_topk_prob": True, "hidden_act": "silu", "torch_dtype": "bfloat16"}


def write_synthetic(directory: Path, w: Widths, layers: int) -> None:
    """An HF-layout bf16 checkpoint; tensor contents are tiled random bytes (conversion does not care)."""
    import torch

    from megatron_gspo.convert import mapping
    from megatron_gspo.convert.hf_config import shape_from_hf_dict
    from megatron_gspo.convert.safetensors_io import INDEX_FILE, ShardWriter, plan_shards

    directory.mkdir(parents=True)
    cfg = config(w, layers)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    shape = shape_from_hf_dict(cfg)
    specs = [(name, s, torch.bfloat16) for item in mapping.items(shape)
             for name, s in zip(item.hf_names, mapping.hf_shapes(shape, item))]
    block = torch.randn(1 << 24, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    shards = plan_shards(specs, 5 * 10**9)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        writer = ShardWriter(directory / file, shard)
        for name, s, dtype in shard:
            n = torch.Size(s).numel()
            data = (block[:n] if n <= block.numel() else block.repeat(-(-n // block.numel()))[:n]).view(s)
            writer.write(name, data)
            weight_map[name] = file
        writer.close()
    total = sum(torch.Size(s).numel() * 2 for _, s, _ in specs)
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))


def dir_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def plain_copy(src: Path, dst: Path) -> float:
    start = time.perf_counter()
    dst.mkdir()
    for f in sorted(src.iterdir()):
        shutil.copyfile(f, dst / f.name)
        with open(dst / f.name, "rb+") as handle:
            os.fsync(handle.fileno())
    return time.perf_counter() - start


def drop_from_page_cache(directory: Path) -> None:
    """Evict the (clean, fsynced) pages of the files in `directory` from the page cache."""
    for f in directory.iterdir():
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def high_water_mark() -> int:
    """This process's peak RSS in bytes (VmHWM). Not ru_maxrss: Linux carries that over from the
    parent through fork + exec, so a child would report the benchmark driver's own peak."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def pairs(reps: int, source: Path, copy, convert, output: Path, cold: bool) -> list[tuple[float, dict]]:
    """(copy seconds, conversion report) per rep, the copy right before the conversion; the
    conversion's output is kept from the last rep."""
    out = []
    for _ in range(reps):
        shutil.rmtree(output, ignore_errors=True)
        if cold:
            drop_from_page_cache(source)
        seconds = copy()
        shutil.rmtree(output.parent / "copy")
        if cold:
            drop_from_page_cache(source)
        out.append((seconds, convert()))
    return out


def child(direction: str, args: list[str]) -> None:
    """Runs in a subprocess: one conversion; prints JSON with its time and memory."""
    from megatron_gspo.convert import convert_hf_to_mcore, convert_mcore_to_hf

    base = high_water_mark()
    start = time.perf_counter()
    if direction == "hf2mcore":
        convert_hf_to_mcore(args[0], args[1], progress=False)
    else:
        convert_mcore_to_hf(args[0], args[1], args[2], progress=False)
    seconds = time.perf_counter() - start
    peak = high_water_mark()
    print(json.dumps({"seconds": seconds, "peak": peak, "base": base}))


def run_child(direction: str, *paths: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", direction, *map(str, paths)],
                         check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(size: int, runs: list[tuple[float, dict]], layer: int) -> dict:
    ratios = sorted(copy / r["seconds"] for copy, r in runs)
    rates = sorted(size / r["seconds"] for _, r in runs)
    copies = sorted(size / copy for copy, _ in runs)
    return {"copy": statistics.median(copies), "rate": statistics.median(rates), "ratio": statistics.median(ratios),
            "low": ratios[0], "high": ratios[-1], "peak": max(r["peak"] for _, r in runs),
            "x_layer": max(r["peak"] - r["base"] for _, r in runs) / layer}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--experts", type=int, default=128, help="experts per layer (128 for the real widths)")
    p.add_argument("--workdir", default=None, help="where to write (default: a temp dir under /tmp)")
    p.add_argument("--reps", type=int, default=3, help="copy/convert pairs per direction and depth")
    p.add_argument("--cold", action="store_true", help="drop the input from the page cache before each run")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.child[0], args.child[1:])

    w = Widths(experts=args.experts)
    layer = max(w.layer_bytes(), 2 * w.vocab * w.hidden * 2)
    need = 2 * w.model_bytes(max(args.layers))  # input + (copy or output); the HF weights go after hf->mcore
    root = Path(tempfile.mkdtemp(prefix="convert-bench-", dir=args.workdir))
    free = shutil.disk_usage(root).free
    if free < need * 1.2:
        shutil.rmtree(root)
        sys.exit(f"{root}: {free / 1e9:.1f} GB free, need ~{need * 1.2 / 1e9:.1f} GB")
    GB = 1e9
    print(f"widths: hidden {w.hidden}, {w.experts} experts x {w.expert_ffn}, vocab {w.vocab}, bf16; "
          f"largest layer {layer / GB:.2f} GB; page cache {'cold' if args.cold else 'warm'}; work dir {root}")
    rows = []
    try:
        for layers in args.layers:
            d = root / f"L{layers}"
            write_synthetic(d / "hf", w, layers)
            size = dir_bytes(d / "hf")
            # Each direction against a copy of its own input made just before it.
            to_mcore = pairs(args.reps, d / "hf", lambda: plain_copy(d / "hf", d / "copy"),
                             lambda: run_child("hf2mcore", d / "hf", d / "mcore"), d / "mcore", args.cold)
            (d / "config").mkdir()
            shutil.copy(d / "hf" / "config.json", d / "config")
            shutil.rmtree(d / "hf")
            release = d / "mcore" / "release"
            to_hf = pairs(args.reps, release, lambda: plain_copy(release, d / "copy"),
                          lambda: run_child("mcore2hf", d / "mcore", d / "config", d / "back"), d / "back", args.cold)
            for name, runs in (("hf->mcore", to_mcore), ("mcore->hf", to_hf)):
                print(f"  {layers} layers {name}: " + ", ".join(
                    f"copy {size / c / GB:.2f} vs {size / r['seconds'] / GB:.2f} GB/s ({c / r['seconds']:.2f}x)"
                    for c, r in runs), flush=True)
            rows.append((layers, size, summary(size, to_mcore, layer), summary(size, to_hf, layer)))
            shutil.rmtree(d)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"\n{'':>15} | {'hf->mcore':^56} | {'mcore->hf':^56}")
    header = f"{'copy GB/s':>9} {'GB/s':>6} {'x copy (range)':>16} {'peak RSS GB':>11} {'x layer':>7}"
    print(f"{'layers':>6} {'size GB':>8} | {header} | {header}")
    for layers, size, a, b in rows:
        cells = [f"{r['copy'] / GB:>9.2f} {r['rate'] / GB:>6.2f} {r['ratio']:>5.2f} ({r['low']:.2f}-{r['high']:.2f}) "
                 f"{r['peak'] / GB:>11.2f} {r['x_layer']:>7.2f}" for r in (a, b)]
        print(f"{layers:>6} {size / GB:>8.2f} | {cells[0]} | {cells[1]}")
    print(f"(medians over {args.reps} copy/convert pairs; peak RSS includes ~0.3 GB of Python + torch, "
          "'x layer' subtracts the RSS after imports)")

    _, _, a, b = rows[-1]
    for name, widths, n in (("Qwen3-30B-A3B", QWEN3_30B, 48), ("Qwen3-235B-A22B", QWEN3_235B, 94)):
        total = widths.model_bytes(n)
        big = max(widths.layer_bytes(), 2 * widths.vocab * widths.hidden * 2)
        print(f"projection {name}: {total / GB:.0f} GB; hf->mcore ~{total / a['rate'] / 60:.1f} min, "
              f"mcore->hf ~{total / b['rate'] / 60:.1f} min at the median rates above; peak RSS ~"
              f"{max(a['x_layer'], b['x_layer']) * big / GB + 0.3:.1f} GB "
              f"(the measured multiple of the largest layer, {big / GB:.2f} GB, + 0.3 GB)")


if __name__ == "__main__":
    main()
