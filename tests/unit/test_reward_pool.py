"""RewardPool: worker processes score samples like direct calls, in parallel, and survive hangs,
crashes and bad return values; a function that fails on the first samples is given up on within about
two timeouts, one hostile response costs only its own reward; workers=0 only for bounded built-ins;
check_batch; the score CLI."""
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_gspo.rewards.pool import RewardError, RewardPool, Score, check_batch
from megatron_gspo.rewards.verifiers import BUILTIN
from megatron_gspo.samples import Sample

UNIT = Path(__file__).parent


def sample(response, answer="7", index=0, metadata=None):
    return Sample(group_id=5, sample_index=index, prompt_ids=[], response_ids=[], rollout_logprobs=[],
                  finish_reason="stop", response_text=response, answer=answer, metadata=metadata)


def children():
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.mark.parametrize("fn, workers", [("math", 2), ("exact_match", 0)])  # 0: in this process
def test_scores_match_direct_calls_in_order(fn, workers):
    samples = [sample(r, a, i) for i, (r, a) in enumerate([
        ("\\boxed{0.5}", "\\frac{1}{2}"), ("The answer is 7.", "7"), ("\\boxed{8}", "7"),
        ("\\boxed{(1,2]}", "(1,2]"), ("nothing", "3"), ("7", "7")])]
    before = children()
    with RewardPool(fn, workers=workers, timeout_s=10) as pool:
        scores = pool.score(samples)
        assert len(children() - before) == workers
    assert scores == [Score(BUILTIN[fn](s), "ok") for s in samples]
    if fn == "math":
        assert [s.value for s in scores] == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]


def test_submit_returns_futures_at_once_and_two_workers_run_in_parallel():
    samples = [sample("x", index=i) for i in range(6)]   # 6 x 0.3 s
    with RewardPool("reward_fns:sleepy", workers=1, timeout_s=10) as pool:
        start = time.perf_counter()
        pool.score(samples)
        serial = time.perf_counter() - start
    with RewardPool("reward_fns:sleepy", workers=2, timeout_s=10) as pool:
        start = time.perf_counter()
        futures = pool.submit(samples)
        assert time.perf_counter() - start < 0.1 and not all(f.done() for f in futures)
        assert [f.result().value for f in futures] == [1.0] * 6
        parallel = time.perf_counter() - start
    assert serial > 1.7 and parallel < 0.75 * serial, (serial, parallel)


def test_hang_times_out_and_a_replacement_worker_goes_on():
    samples = [sample("a", index=0), sample("hang", index=1), sample("b", index=2)]
    with RewardPool("reward_fns:hang_on_hang", workers=1, timeout_s=0.5) as pool:
        before = pool.worker_pids()
        start = time.perf_counter()
        scores = pool.score(samples)
        assert time.perf_counter() - start < 3.0
        assert [s.status for s in scores] == ["ok", "timeout", "ok"]
        assert scores[1].value == 0.0 and "0.5 s" in scores[1].detail
        assert pool.replacements == 1 and pool.worker_pids() != before
        assert not psutil.pid_exists(before[0]) or psutil.Process(before[0]).status() == psutil.STATUS_ZOMBIE


def test_exit_is_an_error_and_the_worker_is_replaced():
    with RewardPool("reward_fns:exit_on_exit", workers=1, timeout_s=5) as pool:
        scores = pool.score([sample("exit"), sample("fine")])
        assert scores[0] == Score(0.0, "error", "worker died (exit code 3)")
        assert scores[1] == Score(1.0, "ok") and pool.replacements == 1


def test_segfault_is_an_error():
    with RewardPool("reward_fns:segfault", workers=1, timeout_s=5) as pool:
        (score,) = pool.score([sample("x")])
    assert score.status == "error" and score.detail == "worker died (exit code -11, SIGSEGV)"


@pytest.mark.parametrize("fn, detail", [
    ("raises", "raised KeyError: 'no such field'"),
    ("nan", "returned nan (need a finite number)"),
    ("text", "returned '1.0' of type str (need a number)"),
])
def test_bad_functions_are_errors_and_the_worker_survives(fn, detail):
    # 3 failures of 2 workers: fewer than the 4 (2 x workers) that give up on the function
    with RewardPool(f"reward_fns:{fn}", workers=2, timeout_s=5) as pool:
        scores = pool.score([sample("x"), sample("y"), sample("z")])
        assert scores == [Score(0.0, "error", detail)] * 3 and pool.replacements == 0


@pytest.mark.parametrize("workers", [1, 0])
def test_unparsed_is_a_zero_counted_apart_from_errors(workers):
    # final_answer raises megatron_gspo.rewards.Unparsed on a response without an "answer: N" line; in a
    # worker (run as __main__) and in this process alike it must come back as "unparsed", not "error".
    with RewardPool("final_answer", workers=workers, timeout_s=10) as pool:
        scores = pool.score([sample("answer: 7"), sample("seven"), sample("answer: 8")])
    assert scores == [Score(1.0, "ok"), Score(0.0, "unparsed", "no line 'answer: N' in the response"),
                      Score(0.0, "ok")]
    # A batch where nothing parses is a policy that has not learnt the format, not a broken verifier.
    check_batch([scores[1]] * 4, [sample("seven", index=i) for i in range(4)], "final_answer")


def test_stdout_noise_does_not_break_the_protocol():
    with RewardPool("reward_fns:prints", workers=1, timeout_s=5) as pool:
        assert pool.score([sample("x")] * 3) == [Score(0.5, "ok")] * 3


@pytest.mark.parametrize("workers", [2, 1])
def test_load_failure_raises_at_construction_and_leaves_no_process(workers):
    before = children()
    with pytest.raises(RewardError, match="'reward_fns:missing' cannot be loaded: .*no attribute 'missing'"):
        RewardPool("reward_fns:missing", workers=workers)
    assert children() <= before


def test_close_stops_every_worker_and_is_idempotent():
    before = children()
    pool = RewardPool("math", workers=2, timeout_s=5)
    pids = pool.worker_pids()
    assert set(pids) <= children() - before
    pool.score([sample("7")])
    pool.close()
    pool.close()
    assert children() <= before and not any(psutil.pid_exists(p) for p in pids)
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit([sample("7")])


def test_worker_starts_fast_without_torch():
    start = time.perf_counter()
    with RewardPool("reward_fns:torch_loaded", workers=1, timeout_s=5) as pool:
        started = time.perf_counter() - start
        assert pool.score([sample("x")]) == [Score(0.0, "ok")]   # torch is not in the worker's modules
    assert started < 3.0, started   # ~0.3 s here; importing torch alone takes seconds


def test_check_batch():
    samples = [sample(f"response {i}", index=i) for i in range(4)]
    ok, bad = Score(1.0, "ok"), Score(0.0, "error", "raised KeyError: 'x'")
    check_batch([ok, ok, bad, bad], samples, "reward_fns:raises")   # half failing: no raise
    with pytest.raises(RewardError) as info:
        check_batch([ok, Score(0.0, "timeout", "no result"), bad, bad], samples, "reward_fns:raises")
    message = str(info.value)
    assert "'reward_fns:raises' failed on 3 of 4 samples (1 timeouts, 2 errors)" in message
    assert "group 5 sample 1 (response 'response 1'): timeout: no result" in message


def run_cli(*args):
    code = "import sys; from megatron_gspo.rewards.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(UNIT.parents[1]), str(UNIT)])}
    return subprocess.run([sys.executable, "-c", code, "score", *args], capture_output=True, text=True,
                          env=env, timeout=60)


def test_score_cli_prints_the_reward_last():
    done = run_cli("--answer", "\\frac{1}{2}", "--response", "so \\boxed{0.5}")
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "1.0"
    done = run_cli("--fn", "reward_fns:hang_on_hang", "--answer", "1", "--response", "hang", "--timeout-s", "0.3")
    assert done.returncode == 1 and done.stdout.splitlines()[-1] == "0.0"
    assert "timeout" in done.stderr
    done = run_cli("--fn", "final_answer", "--answer", "1", "--response", "one")   # a zero, not a failure
    assert done.returncode == 0 and done.stdout.splitlines() == [
        "reward final_answer: unparsed: no line 'answer: N' in the response", "0.0"]
    done = run_cli("--fn", "reward_fns:missing", "--answer", "1", "--response", "1")
    assert done.returncode == 1 and "cannot be loaded" in done.stderr


def test_math_on_a_power_tower_times_out_instead_of_hanging():
    # math-verify (SymPy) tries to evaluate 9^(9^(9^9)) and does not return: the pool's deadline
    # is what keeps such a response from stalling a training step.
    with RewardPool("math", workers=1, timeout_s=0.5) as pool:
        scores = pool.score([sample("\\boxed{9^{9^{9^{9}}}}"), sample("\\boxed{7}")])
    assert [s.status for s in scores] == ["timeout", "ok"] and scores[1].value == 1.0


def test_a_function_that_always_hangs_is_given_up_on_within_two_timeouts(tmp_path):
    # 2 workers, 1 s each: samples 0-1 time out at ~1 s, 2-3 at ~2 s (after the replacements start), and
    # the 4th failure in a row (2 x workers) gives up: the 12 queued samples are never run.
    log = tmp_path / "started"
    samples = [sample("x", index=i, metadata={"log": str(log)}) for i in range(16)]
    before = children()
    with RewardPool("reward_fns:hangs", workers=2, timeout_s=1) as pool:
        start = time.perf_counter()
        futures = pool.submit(samples)
        with pytest.raises(RewardError) as info:
            [f.result() for f in futures]
        took = time.perf_counter() - start
        assert took < 3.0, took   # before: 16 x 1 s / 2 workers = 8 s, then every sample a timeout
        assert sum(not f.exception() for f in futures) == 3   # 3 timeouts; the 4th and every other sample raise
        assert all(f.exception() is info.value for f in futures if f.exception())
        assert pool.failure is info.value
        with pytest.raises(RewardError):   # and so does anything submitted later
            pool.score([sample("z")])
        time.sleep(1.2)   # past a timeout: nothing queued starts after the pool gave up
        started = [int(i) for i in log.read_text().split()]
        assert len(started) <= 6 and set(started) <= {0, 1, 2, 3, 4, 5}, started  # at most 1 in flight per worker
    assert children() <= before
    message = str(info.value)
    assert message.startswith("reward function 'reward_fns:hangs' failed on its first 4 samples in a row "
                              "(4 timed out after 1 s): is it broken?"), message
    assert "megatron-gspo score --fn reward_fns:hangs" in message
    assert "First failure: group 5 sample " in message and "timeout: no result within 1 s" in message


@pytest.mark.parametrize("workers", [2, 0])   # 0: final_answer scored in this process
def test_a_function_that_always_errors_is_given_up_on_at_once(workers):
    # final_answer raises ValueError on a reference answer that is not an integer (as a broken function
    # raises on every sample): 2 x max(workers, 1) errors in a row, the rest never scored.
    samples = [sample("answer: 7", answer="seven", index=i) for i in range(64)]
    with RewardPool("final_answer", workers=workers, timeout_s=5) as pool:
        start = time.perf_counter()
        futures = pool.submit(samples)
        with pytest.raises(RewardError, match=rf"'final_answer' failed on its first {2 * max(workers, 1)} samples "
                                              rf"in a row \({2 * max(workers, 1)} errors\).*First failure: group 5 "
                                              r"sample \d+ \(response 'answer: 7'\): error: raised ValueError"):
            [f.result() for f in futures]
        assert time.perf_counter() - start < 1.0
        assert sum(not f.exception() for f in futures) == 2 * max(workers, 1) - 1


def test_one_hostile_response_costs_only_its_own_reward():
    # First sample hostile, then fine: one failure of the 2 that would give up (workers=1).
    with RewardPool("reward_fns:hang_on_hang", workers=1, timeout_s=0.3) as pool:
        assert [s.status for s in pool.score([sample("hang"), sample("a"), sample("b")])] == ["timeout", "ok", "ok"]
        # Later in the run even several in a row only cost their own rewards: the function has worked.
        statuses = [s.status for s in pool.score([sample("hang"), sample("hang"), sample("hang"), sample("c")])]
        assert statuses == ["timeout", "timeout", "timeout", "ok"] and pool.failure is None


def test_workers_0_only_for_functions_known_to_be_bounded():
    # In the calling thread no time limit can be enforced: math (SymPy can hang) and user functions need workers.
    for fn in ("math", "reward_fns:hang_on_hang"):
        with pytest.raises(ValueError, match=rf"workers=0 .*no time limit can be enforced: only for exact_match, "
                                             rf"final_answer, none, not '{fn}' \(use workers >= 1\)"):
            RewardPool(fn, workers=0)
