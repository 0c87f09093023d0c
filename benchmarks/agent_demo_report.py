"""What the agent demo's model does with its calculator, read from a run's saved rollouts (logging.save_rollouts).

Per saved step of examples/tiny_agent_cpu.yaml's run (run_dir/rollouts/step_NNNNNN.jsonl) it prints the mean
reward and tool calls per episode, and three rates that tell using the tool from memorising the training answers:
- operands right: a call that ran had the prompt's two numbers (either order);
- relayed: the final "answer:N" is the last call's result;
- right via the tool: rewarded with the operands right and the result relayed.
A reward that rises while "right via the tool" does not is the model recalling each training prompt's product
(30 prompts, 21 products) and calling the calculator as a ritual.

    python benchmarks/agent_demo_report.py runs/tiny_agent_cpu
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ANSWER = re.compile(r"answer:\s*(-?\d+)")


def rates(rows: list[dict]) -> dict[str, float]:
    """The module doc's rates over one step's saved samples (the multiplication task's prompts: "...\\nA*B=")."""
    counts = dict(reward=0.0, calls=0.0, operands=0, relayed=0, via_tool=0)
    for r in rows:
        a, b = r["prompt"].rsplit("\n", 1)[-1].rstrip("=").split("*")
        ran = [c for c in r["tool_calls"] if c["result"] is not None]
        operands = any(isinstance(c["arguments"], dict) and str(c["arguments"].get("expression", "")).replace(" ", "")
                       in (f"{a}*{b}", f"{b}*{a}") for c in ran)
        stated = ANSWER.findall(r["turns"][-1]["text"]) if r["turns"] else []
        relayed = bool(ran and stated and stated[-1] == ran[-1]["result"])
        counts["reward"] += r["reward"]
        counts["calls"] += len(r["tool_calls"])
        counts["operands"] += operands
        counts["relayed"] += relayed
        counts["via_tool"] += r["reward"] > 0 and operands and relayed
    return {k: v / len(rows) for k, v in counts.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_dir")
    args = p.parse_args(argv)
    files = sorted((Path(args.run_dir) / "rollouts").glob("step_*.jsonl"))
    if not files:
        raise SystemExit(f"no {args.run_dir}/rollouts/step_*.jsonl (logging.save_rollouts was off?)")
    print(f"{'step':>6s}{'samples':>9s}{'reward':>8s}{'calls':>7s}{'operands right':>16s}{'relayed':>9s}"
          f"{'right via the tool':>20s}")
    for path in files:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        r = rates(rows)
        print(f"{int(path.stem.split('_')[1]):6d}{len(rows):9d}{r['reward']:8.3f}{r['calls']:7.2f}{r['operands']:16.3f}"
              f"{r['relayed']:9.3f}{r['via_tool']:20.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
