"""Rollout servers as their own jobs: one SGLang server in the foreground, and a wait for servers elsewhere.

Multi-node jobs (scripts/slurm/gspo.sbatch) run `megatron-gspo serve` on the rollout nodes and give the
trainer their URLs (`rollout.server_urls`); `megatron-gspo wait-servers` holds the trainer back until every
server answers. Only the standard library and `server.py` are used here, so `serve` also runs in an
SGLang-only environment or container.
"""
from __future__ import annotations

import signal
import sys
import time

from megatron_gspo.rollout.sglang.server import ServerConfig, SGLangServer, health_generate


class _Stop(Exception):
    pass


def serve(config: ServerConfig, port: int) -> int:
    """Run one SGLang server until SIGTERM/SIGINT (then stop it and return 0) or until it exits on its own
    (return its exit code, 1 if that was 0: a server is not supposed to end by itself)."""
    def on_signal(signum, frame):
        raise _Stop(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    server = SGLangServer(config, port=port)
    try:
        server.start()
        print(f"SGLang server starting on {config.host}:{port} (model {config.model_path}, log {server.log_path})",
              flush=True)
        ready_s = server.wait_ready()
        print(f"SGLang server ready on {config.host}:{port} after {ready_s:.0f} s", flush=True)
        code = server.process.wait()
        print(f"SGLang server exited with code {code}; log {server.log_path}, last lines:\n{server.log_tail()}",
              file=sys.stderr, flush=True)
        return code or 1
    except _Stop as stop:
        print(f"{stop}: stopping the SGLang server on port {port}", flush=True)
        return 0
    finally:
        for sig in previous:  # a second signal must not interrupt the stop below
            signal.signal(sig, signal.SIG_IGN)
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def wait_for_servers(urls: list[str], timeout_s: float, api_key: str | None = None,
                     poll_s: float = 2.0) -> float:
    """Block until every URL answers /health_generate (a real one-token generation); seconds waited.

    Raises TimeoutError naming the servers that never answered."""
    start = time.monotonic()
    pending = list(urls)
    while True:
        pending = [u for u in pending if not health_generate(u, api_key, timeout_s=10)]
        if not pending:
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"rollout servers not ready after {timeout_s:.0f} s: {', '.join(pending)}")
        time.sleep(poll_s)
