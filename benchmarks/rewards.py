"""Benchmark: reward pool throughput on the math verifier, and the cost of hostile responses.

Throughput: N realistic responses (a few hundred characters of reasoning ending in \\boxed{...};
random integers, fractions, decimals, sqrt, intervals, sets; about half correct) are scored through
RewardPool("math") with 1 and 2 workers, after a warm-up batch (SymPy's first parses are slow).
Reported: samples/s, and the speed-up of 2 workers over 1 (bounded by the free cores).

Pathological responses are scored one at a time with `math_reward` in this process (no pool, no
time limit) to show what the bounded tail (MAX_RESPONSE_CHARS) costs: a 10^6-character response,
10^5 digits, and 10^5 nested braces. Each must take about as long as a normal response, not grow
with the input.

    python benchmarks/rewards.py              # 400 samples
    python benchmarks/rewards.py --samples 100
"""
from __future__ import annotations

import argparse
import random
import time

from megatron_gspo.rewards.pool import RewardPool
from megatron_gspo.rewards.verifiers import MAX_RESPONSE_CHARS, math_reward
from megatron_gspo.samples import Sample

# (gold, an equivalent prediction, a wrong one) from random numbers: math-verify caches parses of
# identical strings, so a handful of fixed answers would measure its cache, not its parser.
ANSWER_FORMS = [
    lambda a, b: (str(a), str(a), str(a + 1)),
    lambda a, b: (f"\\frac{{{a}}}{{{b}}}", f"\\frac{{{2 * a}}}{{{2 * b}}}", f"\\frac{{{a + 1}}}{{{b}}}"),
    lambda a, b: (f"{a}\\sqrt{{2}}", f"\\sqrt{{{2 * a * a}}}", f"{a}\\sqrt{{3}}"),
    lambda a, b: (f"({a},{a + b}]", f"({a},{a + b}]", f"[{a},{a + b}]"),
    lambda a, b: (f"{a / 4}", f"\\frac{{{a}}}{{4}}", f"{a / 4 + 0.5}"),
    lambda a, b: (f"\\{{{a},{b}\\}}", f"\\{{{b},{a}\\}}", f"\\{{{a}\\}}"),
]
REASONING = ("Let us set up the equation. Subtracting 3 from both sides gives 2x = 11, so x = 11/2. "
             "Checking the constraint $x > 0$ we keep this root. Substituting back, $2(11/2) + 3 = 14$. ")


def realistic(n: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        gold, right, wrong = ANSWER_FORMS[i % len(ANSWER_FORMS)](rng.randint(1, 999), rng.randint(1000, 1999))
        final = right if rng.random() < 0.5 else wrong
        text = REASONING * rng.randint(1, 4) + f"Therefore the answer is $\\boxed{{{final}}}$."
        samples.append(Sample(group_id=i // 8, sample_index=i % 8, prompt_ids=[], response_ids=[],
                              rollout_logprobs=[], finish_reason="stop", response_text=text, answer=gold))
    return samples


def throughput(samples: list[Sample], workers: int) -> tuple[float, float, float]:
    """(seconds to start the pool, samples/s, mean reward) for one pool."""
    start = time.perf_counter()
    with RewardPool("math", workers=workers, timeout_s=30) as pool:
        started = time.perf_counter() - start
        pool.score(samples[:16 * workers])  # warm-up: SymPy/latex2sympy first-call costs in each worker
        start = time.perf_counter()
        scores = pool.score(samples)
        elapsed = time.perf_counter() - start
    assert all(s.status == "ok" for s in scores), [s for s in scores if s.status != "ok"][:3]
    return started, len(samples) / elapsed, sum(s.value for s in scores) / len(scores)


def pathological() -> list[tuple[str, int, float, float]]:
    """(name, characters, seconds, reward) of hostile responses scored directly."""
    cases = {
        "normal (realistic)": realistic(1)[0].response_text,
        "10^6 chars, answer at end": "blah " * 200_000 + "\\boxed{7}",
        "10^5 digits": "1" * 100_000,
        "10^5 digits in \\boxed{}": "\\boxed{" + "9" * 100_000 + "}",
        "10^5 nested braces": "{" * 100_000 + "7" + "}" * 100_000,
        "10^4 nested \\frac": "\\frac{" * 10_000 + "1" + "}{2}" * 10_000,
    }
    math_reward(realistic(2, seed=1)[1])  # first call: SymPy/latex2sympy set-up, not part of any case
    rows = []
    for name, text in cases.items():
        sample = Sample(group_id=0, sample_index=0, prompt_ids=[], response_ids=[], rollout_logprobs=[],
                        finish_reason="stop", response_text=text, answer="7")
        start = time.perf_counter()
        reward = math_reward(sample)
        rows.append((name, len(text), time.perf_counter() - start, reward))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=400)
    args = parser.parse_args()
    samples = realistic(args.samples)
    print(f"math verifier through RewardPool, {args.samples} realistic responses")
    print(f"{'workers':>8} {'start s':>8} {'samples/s':>10} {'mean reward':>12}")
    rates = {}
    for workers in (1, 2):
        started, rates[workers], mean = throughput(samples, workers)
        print(f"{workers:>8} {started:>8.2f} {rates[workers]:>10.1f} {mean:>12.3f}")
    print(f"speed-up 2 vs 1 worker: {rates[2] / rates[1]:.2f}x")
    print(f"\npathological responses, math_reward directly (tail of {MAX_RESPONSE_CHARS} chars parsed)")
    print(f"{'response':<28} {'chars':>9} {'ms':>8} {'reward':>7}")
    for name, chars, seconds, reward in pathological():
        print(f"{name:<28} {chars:>9} {seconds * 1000:>8.1f} {reward:>7}")


if __name__ == "__main__":
    main()
