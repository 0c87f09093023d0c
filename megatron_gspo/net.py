"""Small network helpers shared by the rollout servers, the weight sync and the launchers."""
from __future__ import annotations

import functools
import socket
import ssl

import certifi


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (the OS picks it): for servers and torch.distributed rendezvous."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The HTTP headers SGLang's `--api-key` asks for; none without a key. Every client here uses these."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


@functools.cache
def tls_context() -> ssl.SSLContext:
    """One certificate-verifying TLS context per process, for every httpx client here (`verify=`).

    httpx builds a fresh one per client otherwise, loading certifi's CA bundle each time: ~35 ms per
    client on this 2-core machine, paid per rollout step (one AsyncClient) and per weight push (one
    client per server), whether or not the URL is https."""
    return ssl.create_default_context(cafile=certifi.where())
