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
exact_match samples against ~15 ms through two workers, measured here), and no protection: no time limit,
and a crash or a hang of the function is the trainer's. For cheap, trusted functions (exact_match).

`check_batch` turns a batch where most samples failed into a RewardError: a broken reward function
should stop the run, while an occasional hostile response should only cost its own reward.
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

from megatron_gspo.rewards.worker import _LENGTH, score_one, write_message
from megatron_gspo.samples import Sample

REWARD_HANDLER = "megatron_gspo.rewards.worker:reward_handler"

STARTUP_TIMEOUT_S = 60.0
"""A worker must load the reward function and answer the handshake within this time."""
EXIT_GRACE_S = 2.0
"""On close, a worker that has not exited this long after its stdin closed is killed."""


class RewardError(RuntimeError):
    """The reward function cannot be loaded, or failed on most of a batch; the message says which."""


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
        self.proc = subprocess.Popen([sys.executable, "-m", "megatron_gspo.rewards.worker", *argv],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0)
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


class WorkerPool:
    """Answers requests with a handler in `workers` processes, `timeout_s` per request (module docstring).

    Construction starts the workers and raises `error` (naming `what`) if the handler cannot be loaded.
    `submit` is thread-safe and returns at once; each future holds `result(status, payload)` of the reply:
    the handler's own, ("timeout", detail) past the time limit, or ("died", detail) when the worker died.
    Use as a context manager or call `close()` (idempotent): it stops every worker process.
    """

    def __init__(self, handler: str, args: Sequence[str], *, what: str, workers: int = 2, timeout_s: float = 10.0,
                 result: Callable[[str, Any], Any] = lambda status, payload: (status, payload),
                 error: type[Exception] = RuntimeError):
        if workers < 1:
            raise ValueError(f"{what}: workers must be >= 1, got {workers}")
        if not timeout_s > 0:
            raise ValueError(f"{what}: timeout_s must be > 0, got {timeout_s}")
        self.what, self.timeout_s, self._argv, self._error = what, timeout_s, [handler, *args], error
        self._result = result
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False
        self.replacements = 0
        """How many workers were killed or died and were replaced (for metrics and tests)."""
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
        """Queue the requests; one Future per request, in order."""
        futures = []
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.what}: the pool is closed")
            for request in requests:
                future: concurrent.futures.Future = concurrent.futures.Future()
                self._jobs.put((request, future))
                futures.append(future)
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
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    future.set_result(self._result(*self._call_on(slot, request)))
                except BaseException as e:  # a replacement failed to start: the pool is unusable
                    future.set_exception(e)
        finally:
            self._workers[slot].stop()

    def _call_on(self, slot: int, request) -> tuple[str, Any]:
        worker = self._workers[slot]
        try:
            worker.send(request)
            return worker.receive(self.timeout_s)
        except TimeoutError:
            worker.kill()
            self._replace(slot)
            return "timeout", f"no result within {self.timeout_s:g} s (worker killed)"
        except (_WorkerDied, BrokenPipeError):
            detail = f"worker died ({worker.exit_description()})"
            worker.kill()
            self._replace(slot)
            return "died", detail

    def _replace(self, slot: int) -> None:
        worker = _Worker(self._argv, self.what, self._error)
        worker.handshake()
        self._workers[slot] = worker
        self.replacements += 1


class RewardPool:
    """Scores samples with a reward function in `workers` processes (a WorkerPool), `timeout_s` per sample,
    or with `workers=0` in the calling thread (module docstring).

    Construction raises RewardError if the function cannot be loaded. `submit` is thread-safe and returns
    at once; `score` blocks. Use as a context manager or call `close()` (idempotent).
    """

    def __init__(self, fn_spec: str, *, workers: int = 2, timeout_s: float = 10.0):
        if workers < 0:
            raise ValueError(f"reward pool: workers must be >= 0, got {workers}")
        if not timeout_s > 0:
            raise ValueError(f"reward pool: timeout_s must be > 0, got {timeout_s}")
        self.fn_spec, self.timeout_s = fn_spec, timeout_s
        self._inline, self._pool, self._closed = None, None, False
        if workers == 0:  # in this process (see the module docstring)
            from megatron_gspo.rewards.verifiers import load_reward_fn  # math-verify: imported when needed
            try:
                self._inline = load_reward_fn(fn_spec)
            except Exception as e:
                raise RewardError(f"reward function {fn_spec!r} cannot be loaded: {type(e).__name__}: {e}") from None
        else:
            self._pool = WorkerPool(REWARD_HANDLER, [fn_spec], what=f"reward function {fn_spec!r}", workers=workers,
                                    timeout_s=timeout_s, result=_reply_score, error=RewardError)

    @property
    def replacements(self) -> int:
        """How many workers were killed or died and were replaced (for metrics and tests)."""
        return self._pool.replacements if self._pool is not None else 0

    def submit(self, samples: Sequence[Sample]) -> list[concurrent.futures.Future]:
        """Queue the samples; one Future[Score] per sample, in order."""
        if self._pool is not None:
            # The MoE routing (up to megabytes per sample) is for the trainer, not the reward function:
            # it is neither pickled nor sent (and the worker need not import numpy to unpickle it).
            return self._pool.submit([dataclasses.replace(s, routed_experts=None) if s.routed_experts is not None
                                      else s for s in samples])
        if self._closed:
            raise RuntimeError("reward pool is closed")
        futures = []
        for sample in samples:
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_result(_score(*score_one(self._inline, sample)))
            futures.append(future)
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


def _reply_score(status: str, payload) -> Score:
    """The Score of a worker's reply (a `score_one` reply, or the pool's timeout / died)."""
    if status == "timeout":
        return Score(0.0, "timeout", payload)
    return _score("error" if status == "died" else status, payload)


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
