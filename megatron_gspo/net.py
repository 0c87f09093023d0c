"""Two small network helpers shared by the rollout servers, the weight sync and the launchers."""
from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (the OS picks it): for servers and torch.distributed rendezvous."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The HTTP headers SGLang's `--api-key` asks for; none without a key. Every client here uses these."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}
