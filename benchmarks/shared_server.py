"""One SGLang server for a benchmark's many `megatron-gspo train` runs, put back to the initial weights before
each (weight version "0", KV cache flushed), so each run starts where a freshly launched server would, without
the ~minute of CPU a launch costs. A run adopts it with `SharedServer.overrides` (rollout.server_urls)."""
from __future__ import annotations

from pathlib import Path


class SharedServer:
    """The server of `config_path` + `overrides` (its rollout settings: dtype, server_args, R3's routed experts),
    serving the HF model at `hf`."""

    def __init__(self, config_path: str | Path, hf: Path, log_dir: Path, overrides: list[str]):
        from megatron_gspo.config import load_config
        from megatron_gspo.rollout.sglang.backend import server_config
        from megatron_gspo.rollout.sglang.server import SGLangServer

        config = load_config(config_path, [f"model.hf_path={hf}", f"logging.run_dir={log_dir}", *overrides])
        self.hf, self.api_key = Path(hf).resolve(), config.rollout.api_key
        self.server = SGLangServer(server_config(config)).start()
        print(f"SGLang server at {self.server.url} (log {self.server.log_path}) ...", flush=True)
        print(f"   ready after {self.server.wait_ready():.0f} s", flush=True)

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def overrides(self) -> list[str]:
        return [f"rollout.server_urls=[{self.url}]"]

    def reset(self) -> None:
        from megatron_gspo.rollout.sglang.weight_sync import connected, sync_from_disk

        with connected([self.url], api_key=self.api_key) as admins:
            sync_from_disk(admins, self.hf, "0")

    def stop(self) -> None:
        self.server.stop()

    def __enter__(self) -> "SharedServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
