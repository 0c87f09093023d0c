"""Run untrusted functions in worker processes, with a per-call time limit: the reward pool, and (the same
pool, another handler) the tools of multi-turn episodes (rollout/agent/tools.py).

`WorkerPool(handler, args, workers=N, timeout_s=T)` starts N `megatron_gspo.rewards.worker` processes
(plain `subprocess.Popen` of `python -m ...`: no fork, since the trainer holds threads and gloo
sockets, and no multiprocessing spawn, which would re-import the trainer's `__main__` with torch
and Megatron in every worker), each answering requests with the handler `handler` makes of `args`
(rewards/worker.py). Each worker is driven by one thread of the pool, which takes the next queued
request, sends it, and waits at most T seconds, timed from the send, for the answer; a worker past its
time is killed and replaced, one that died is replaced, and either way the request's reply says so.

`RewardPool(fn_spec, workers=N, timeout_s=T)` is the reward function's pool: one request per sample.

What can go wrong with a sample, and what it costs:
- the response states no answer the function can read (it raises `Unparsed`): Score(0, "unparsed"),
  an ordinary zero reward for the policy, counted but no failure of the function;
- the function raises or returns a non-number / NaN / inf: Score(0, "error"), the worker goes on;
- it runs past T: the worker is killed and replaced, Score(0, "timeout");
- the worker dies (os._exit, a segfault): Score(0, "error", "worker died (exit code N)"), replaced.

`workers=0` scores in the calling thread instead: no process, no pickling, no pipe (~0.3 ms for 256
exact_match samples against ~15 ms through two workers, measured here), and no time limit, which
cannot be enforced in the caller's thread. So it is refused except for the built-ins whose time is
bounded by the response's length (verifiers.BOUNDED: exact_match, final_answer, none); "math" can hang.

A broken function stops the run, while an occasional hostile response only costs its own reward:
- the pool gives up when the first 2 x max(workers, 1) samples it scores (in the order they finish) all
  fail (time out or error; "unparsed" is a reward, not a failure). Two per worker, so that it takes two timeouts in a row on every
  worker (~2 x timeout_s) rather than one unlucky response; a single success disarms the rule for the
  pool's life, so a hostile response later in the run never stops it. Giving up is at once and final:
  the queued samples are never run, the running ones are killed, and every unresolved Future, and every
  Future submitted from then on, raises the RewardError (`failure`) naming the function, the count and
  one failing sample. (A malformed reference answer on the very first prompt looks the same: every
  sample of its group errors. The message shows the sample, so that is found too.) The give-up is the
  WorkerPool's (`judge`, `failure`), the rule the RewardPool's; the tools' pool has no such rule (a tool's
  failure is a message to the model).
- `check_batch` turns a batch where most samples failed into a RewardError (a function that breaks
  later in the run, or on most but not all responses).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import pickle
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

from megatron_gspo.platform.lifetime import parent_death_preexec
from megatron_gspo.rewards.verifiers import BOUNDED, load_reward_fn
from megatron_gspo.rewards.worker import _LENGTH, score_one, write_message
from megatron_gspo.samples import Sample

REWARD_HANDLER = "megatron_gspo.rewards.worker:reward_handler"

FIRST_FAILURES_PER_WORKER = 2
"""The pool gives up when its first FIRST_FAILURES_PER_WORKER x max(workers, 1) samples all fail."""
STARTUP_TIMEOUT_S = 60.0
"""A worker must load the reward function and answer the handshake within this time."""
EXIT_GRACE_S = 2.0
"""On close, a worker that has not exited this long after its stdin closed is killed."""


class RewardError(RuntimeError):
    """The reward function cannot be loaded, failed on the first samples of the run or on most of a batch;
    the message says which."""


@dataclass(frozen=True)
class Score:
    """The reward of one sample and how it was obtained."""

    value: float
    """The reward; 0.0 unless status is "ok"."""
    status: Literal["ok", "unparsed", "timeout", "error"]
    """"ok": the function returned a finite number; "unparsed": it raised `Unparsed` (the response states
    no answer it can read); "timeout": it ran past the limit; "error": it raised anything else, returned
    something else, or its worker died."""
    detail: str = ""
    """What went wrong, or why nothing was parsed (empty when ok)."""


class _WorkerDied(Exception):
    """The worker's stdout closed (it exited or crashed)."""



class _Worker:
    """One worker process and its pipes."""

    def __init__(self, argv: Sequence[str], what: str, error: type[Exception]):
        self.what, self.error = what, error
        env = dict(os.environ)
        # The worker imports what the parent can import (a user's "module:function" may live on a
        # path the parent added to sys.path, e.g. a test directory).
        paths = [p or os.getcwd() for p in sys.path]
        env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        # SIGKILLed by the kernel when the thread that starts it ends (the trainer killed: platform/lifetime.py)
        self.proc = subprocess.Popen([sys.executable, "-m", "megatron_gspo.rewards.worker", *argv],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0,
                                     preexec_fn=parent_death_preexec())
        self._fd = self.proc.stdout.fileno()

    def handshake(self) -> None:
        """Wait for "ready"; `error` naming what the worker runs if it cannot be loaded."""
        try:
            kind, payload = self.receive(STARTUP_TIMEOUT_S)
        except TimeoutError:
            self.kill()
            raise self.error(f"{self.what}: worker did not start within {STARTUP_TIMEOUT_S:g} s") from None
        except _WorkerDied:
            raise self.error(f"{self.what}: worker exited at start-up ({self.exit_description()})") from None
        if kind != "ready":
            self.kill()
            raise self.error(f"{self.what} cannot be loaded: {payload}")

    def send(self, request) -> None:
        write_message(self.proc.stdin, request)

    def receive(self, timeout_s: float):
        """The next reply; TimeoutError past timeout_s, _WorkerDied on end of stream."""
        deadline = time.monotonic() + timeout_s
        (size,) = _LENGTH.unpack(self._read_exact(_LENGTH.size, deadline))
        return pickle.loads(self._read_exact(size, deadline))

    def _read_exact(self, n: int, deadline: float) -> bytes:
        chunks, got = [], 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(self._fd, n - got)
            if not chunk:
                raise _WorkerDied
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    @property
    def lost(self) -> bool:
        """The process has exited (killed past its deadline, or died)."""
        return self.proc.poll() is not None

    def exit_description(self) -> str:
        code = self.proc.wait()
        if code < 0:
            try:
                return f"exit code {code}, {signal.Signals(-code).name}"
            except ValueError:
                pass
        return f"exit code {code}"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self._close_pipes()

    def stop(self) -> None:
        """Close stdin (the worker's signal to exit), wait briefly, kill if it lingers."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(EXIT_GRACE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._close_pipes()

    def _close_pipes(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


_STOP = object()

Judge = Callable[[Any, Any], "Exception | None"]
"""(request, result) -> an exception when the pool must give up now, else None; called under the pool's lock."""


class WorkerPool:
    """Answers requests with a handler in `workers` processes, `timeout_s` per request (module docstring).

    Construction starts the workers and raises `error` (naming `what`) if the handler cannot be loaded.
    `submit` is thread-safe and returns at once; each future holds `result(status, payload)` of the reply:
    the handler's own, ("timeout", detail) past the time limit, or ("died", detail) when the worker died.
    `judge` (optional) sees each result as it is resolved; when it returns an exception the pool gives up
    (`failure`, module doc): queued requests are never run, running ones are killed, and every unresolved
    and later Future raises it. Use as a context manager or call `close()` (idempotent): it stops every
    worker process.
    """

    def __init__(self, handler: str, args: Sequence[str], *, what: str, workers: int = 2, timeout_s: float = 10.0,
                 result: Callable[[str, Any], Any] = lambda status, payload: (status, payload),
                 error: type[Exception] = RuntimeError, judge: Judge | None = None):
        if workers < 1:
            raise ValueError(f"{what}: workers must be >= 1, got {workers}")
        if not timeout_s > 0:
            raise ValueError(f"{what}: timeout_s must be > 0, got {timeout_s}")
        self.what, self.timeout_s, self._argv, self._error = what, timeout_s, [handler, *args], error
        self._result, self._judge = result, judge
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False
        self.replacements = 0
        """How many workers were killed or died and were replaced (for metrics and tests)."""
        self.failure: Exception | None = None
        """Set when the pool has given up (`judge`, or a replacement worker that cannot start); final."""
        self._running: list[concurrent.futures.Future | None] = [None] * workers
        """The Future each worker is answering (killed when the pool gives up)."""
        started = [_Worker(self._argv, what, error) for _ in range(workers)]  # start together, then wait
        try:
            for w in started:
                w.handshake()
        except BaseException:
            for w in started:
                w.kill()
            raise
        self._workers = started
        self._threads = [threading.Thread(target=self._drive, args=(i,), daemon=True,
                                          name=f"pool-worker-{i}") for i in range(workers)]
        for t in self._threads:
            t.start()

    def submit(self, requests: Sequence) -> list[concurrent.futures.Future]:
        """Queue the requests; one Future per request, in order (raising `failure` once given up)."""
        futures = [concurrent.futures.Future() for _ in requests]
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.what}: the pool is closed")
            if self.failure is None:
                for job in zip(requests, futures):
                    self._jobs.put(job)
                return futures
        _fail(futures, self.failure)
        return futures

    def worker_pids(self) -> list[int]:
        """Process ids of the current workers."""
        return [w.proc.pid for w in self._workers]

    def close(self) -> None:
        """Cancel queued requests, let running ones finish (at most timeout_s), stop the workers."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while True:
                try:
                    item = self._jobs.get_nowait()
                except queue.Empty:
                    break
                item[1].cancel()
            for _ in self._threads:
                self._jobs.put(_STOP)
        for t in self._threads:
            t.join()

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _drive(self, slot: int) -> None:
        """One worker's loop: take a request, answer it, resolve its future; replace a lost worker."""
        try:
            while (item := self._jobs.get()) is not _STOP:
                request, future = item
                with self._lock:
                    given_up = self.failure
                    if given_up is None:
                        if not future.set_running_or_notify_cancel():
                            continue
                        self._running[slot] = future
                if given_up is not None:  # taken off the queue as the pool gave up
                    _settle(future, error=given_up)
                    continue
                result = self._result(*self._call_on(slot, request))
                with self._lock:
                    self._running[slot] = None
                    failure = None if self.failure is not None or self._judge is None else self._judge(request, result)
                    doomed = self._give_up(failure) if failure else []
                _settle(future, result, failure)  # a no-op when another thread's giving up resolved it
                _fail(doomed, failure)
                if self._workers[slot].lost and self.failure is None:
                    try:
                        self._replace(slot)
                    except Exception as e:  # no worker left in this slot: the pool is unusable
                        with self._lock:
                            doomed = self._give_up(e)
                        _fail(doomed, e)
        finally:
            self._workers[slot].stop()

    def _give_up(self, error: Exception) -> list[concurrent.futures.Future]:
        """(Under the lock.) From now on every request fails with `error`: the queued ones, returned for the
        caller to fail outside the lock (their callbacks may call back into the pool), are never run; the
        running ones are returned too and their workers killed (their threads do not replace them)."""
        self.failure = error
        doomed = []
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                break
            if item is _STOP:  # closing: the threads still need theirs
                self._jobs.put(_STOP)
                break
            doomed.append(item[1])
        for slot, future in enumerate(self._running):
            if future is not None:
                self._workers[slot].proc.kill()
                doomed.append(future)
        return doomed

    def _call_on(self, slot: int, request) -> tuple[str, Any]:
        """The reply from this slot's worker, which is killed past the deadline (and left lost)."""
        worker = self._workers[slot]
        try:
            worker.send(request)
            return worker.receive(self.timeout_s)
        except TimeoutError:
            worker.kill()
            return "timeout", f"no result within {self.timeout_s:g} s (worker killed)"
        except (_WorkerDied, BrokenPipeError):
            detail = f"worker died ({worker.exit_description()})"
            worker.kill()
            return "died", detail

    def _replace(self, slot: int) -> None:
        worker = _Worker(self._argv, self.what, self._error)
        worker.handshake()
        self._workers[slot] = worker
        self.replacements += 1


class RewardPool:
    """Scores samples with a reward function in `workers` processes (a WorkerPool), `timeout_s` per sample,
    or with `workers=0` in the calling thread (module docstring).

    Construction raises RewardError if the function cannot be loaded, ValueError for workers=0 with a
    function not known to be bounded. `submit` is thread-safe and returns at once; `score` blocks. Once the
    pool has given up on the function (`failure`, see the module doc), every Future it has not resolved
    raises that RewardError. Use as a context manager or call `close()` (idempotent).
    """

    def __init__(self, fn_spec: str, *, workers: int = 2, timeout_s: float = 10.0):
        if workers < 0:
            raise ValueError(f"reward pool: workers must be >= 0, got {workers}")
        if not timeout_s > 0:
            raise ValueError(f"reward pool: timeout_s must be > 0, got {timeout_s}")
        if workers == 0 and fn_spec not in BOUNDED:
            raise ValueError(f"reward pool: workers=0 scores in the calling thread, where no time limit can be "
                             f"enforced: only for {', '.join(sorted(BOUNDED))}, not {fn_spec!r} (use workers >= 1)")
        self.fn_spec, self.workers, self.timeout_s = fn_spec, workers, timeout_s
        self._inline, self._pool, self._closed = None, None, False
        self._lock = threading.Lock()
        self._inline_failure: RewardError | None = None
        self._first_failures: list[tuple[Sample, Score]] | None = []
        """The failures since the start, while every sample has failed; None after the first success."""
        self._give_up_after = FIRST_FAILURES_PER_WORKER * max(workers, 1)
        if workers == 0:  # in this process (see the module docstring)
            try:
                self._inline = load_reward_fn(fn_spec)
            except Exception as e:
                raise RewardError(f"reward function {fn_spec!r} cannot be loaded: {type(e).__name__}: {e}") from None
        else:
            self._pool = WorkerPool(REWARD_HANDLER, [fn_spec], what=f"reward function {fn_spec!r}", workers=workers,
                                    timeout_s=timeout_s, result=_reply_score, error=RewardError, judge=self._record)

    @property
    def failure(self) -> RewardError | None:
        """Set when the pool has given up on the function (see the module doc); final."""
        return self._pool.failure if self._pool is not None else self._inline_failure

    @property
    def replacements(self) -> int:
        """How many workers were killed or died and were replaced (for metrics and tests)."""
        return self._pool.replacements if self._pool is not None else 0

    def submit(self, samples: Sequence[Sample]) -> list[concurrent.futures.Future]:
        """Queue the samples; one Future[Score] per sample, in order (raising `failure` once given up)."""
        if self._pool is not None:
            # The MoE routing (up to megabytes per sample) is for the trainer, not the reward function:
            # it is neither pickled nor sent (and the worker need not import numpy to unpickle it).
            return self._pool.submit([dataclasses.replace(s, routed_experts=None) if s.routed_experts is not None
                                      else s for s in samples])
        if self._closed:
            raise RuntimeError("reward pool is closed")
        futures = [concurrent.futures.Future() for _ in samples]
        for sample, future in zip(samples, futures):  # workers=0: scored here
            if self._inline_failure is not None:
                future.set_exception(self._inline_failure)
                continue
            score = _score(*score_one(self._inline, sample))
            with self._lock:
                failure = self._record(sample, score)
                if failure:
                    self._inline_failure = failure  # (nothing queued or running: the rest of `samples` fail above)
            _settle(future, score, failure)
        return futures

    def score(self, samples: Sequence[Sample]) -> list[Score]:
        """The Score of every sample, in order (blocks until all are scored)."""
        return [f.result() for f in self.submit(samples)]

    def worker_pids(self) -> list[int]:
        """Process ids of the current workers."""
        return self._pool.worker_pids() if self._pool is not None else []

    def close(self) -> None:
        """Cancel queued samples, let running ones finish (at most timeout_s), stop the workers."""
        self._closed = True
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _record(self, sample: Sample, score: Score) -> RewardError | None:
        """(Under a lock.) Count a sample's outcome; the RewardError when the pool must give up now."""
        if self._first_failures is None:
            return None
        if score.status not in ("timeout", "error"):
            self._first_failures = None  # the function works: later failures cost only their sample
            return None
        self._first_failures.append((sample, score))
        if len(self._first_failures) < self._give_up_after:
            return None
        timeouts = sum(s.status == "timeout" for _, s in self._first_failures)
        errors = len(self._first_failures) - timeouts
        how = ", ".join(part for part in (f"{timeouts} timed out after {self.timeout_s:g} s" if timeouts else "",
                                          f"{errors} errors" if errors else "") if part)
        return RewardError(
            f"reward function {self.fn_spec!r} failed on its first {len(self._first_failures)} samples in a row "
            f"({how}): is it broken? Stopping instead of training on zeros; try it on one response with "
            f"`megatron-gspo score --fn {self.fn_spec} --answer A --response R`. "
            f"First failure: {_describe(*self._first_failures[0])}")


def _reply_score(status: str, payload) -> Score:
    """The Score of a worker's reply (a `score_one` reply, or the pool's timeout / died)."""
    if status == "timeout":
        return Score(0.0, "timeout", payload)
    return _score("error" if status == "died" else status, payload)


def _settle(future: concurrent.futures.Future, result: Any = None, error: BaseException | None = None) -> None:
    """Resolve `future` with `error` or else `result`, unless it is resolved already (the pool gave up on it)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


def _fail(futures: Sequence[concurrent.futures.Future], error: BaseException) -> None:
    for future in futures:
        _settle(future, error=error)


def _score(status: str, payload) -> Score:
    """The Score of a `score_one` reply (the same in a worker and inline)."""
    if status == "ok":
        return Score(payload, "ok")
    return Score(0.0, "unparsed" if status == "unparsed" else "error", payload)


def _describe(sample: Sample, score: Score) -> str:
    text = (sample.response_text or "")[:80]
    return (f"group {sample.group_id} sample {sample.sample_index} (response {text!r}): "
            f"{score.status}: {score.detail}")


def check_batch(scores: Sequence[Score], samples: Sequence[Sample], fn_spec: str) -> None:
    """RewardError when more than half of the batch timed out or failed (the function itself is broken,
    not one hostile response; "unparsed" is a reward, not a failure); the message names the function,
    the counts and one failure."""
    if len(scores) != len(samples):
        raise ValueError(f"check_batch: {len(scores)} scores for {len(samples)} samples")
    failed = [(sample, score) for sample, score in zip(samples, scores) if score.status in ("timeout", "error")]
    if 2 * len(failed) <= len(scores):
        return
    timeouts = sum(score.status == "timeout" for _, score in failed)
    sample, score = failed[0]
    raise RewardError(f"reward function {fn_spec!r} failed on {len(failed)} of {len(scores)} samples "
                      f"({timeouts} timeouts, {len(failed) - timeouts} errors); first: {_describe(sample, score)}")
