"""Resident-memory readings for the benchmarks (Linux /proc): the one copy they all use."""
from __future__ import annotations


def mem_kb(field: str) -> int:
    """A `/proc/self/status` field in kB, e.g. "VmRSS" (now) or "VmHWM" (peak since the last reset)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
