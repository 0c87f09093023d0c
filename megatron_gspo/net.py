"""Small network helpers shared by the rollout servers, the weight sync and the launchers."""
from __future__ import annotations

import functools
import random
import socket
import ssl

import certifi


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (the OS picks it): for servers and torch.distributed rendezvous."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ephemeral_port_range() -> tuple[int, int]:
    """The ports the OS hands out for bind(0) and outgoing connections (Linux: ip_local_port_range)."""
    try:
        low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def server_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A TCP port free on `host` now and outside the OS's ephemeral range, for a server that binds it only
    seconds later. An ephemeral port (`free_port`) can meanwhile be given to another socket of this
    machine: an SGLang server started beside Megatron's initialisation, whose gloo groups open many
    sockets on ephemeral ports, once found its port taken ("address already in use")."""
    rng = rng or random.Random()
    low = ephemeral_port_range()[0]
    if low <= 20000:
        return free_port(host)
    for _ in range(100):
        port = rng.randint(20000, low - 1)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port
    return free_port(host)


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
