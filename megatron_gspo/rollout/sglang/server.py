"""Starting and stopping SGLang servers as subprocesses (or attaching to running ones).

A server runs in its own process group (SGLang forks a scheduler and a detokenizer), so stopping it
is SIGTERM to the group, then SIGKILL after a grace period: no orphan keeps a port or memory; the
files SGLang leaves in /dev/shm (its own, found through its processes) are removed after it.
If the process that started a server dies without stopping it (SIGKILL, OOM), the kernel kills the
server too (Linux parent-death signal, platform/lifetime.py; SGLang's own children follow their parent
that way).
On CPU the server runs from the SGLang virtual environment (scripts/setup_sglang.sh) with the import
stand-ins of `platform/sglang_cpu_stubs/` on its PYTHONPATH; the trainer only talks HTTP to it and never
imports SGLang.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Literal

from megatron_gspo.config import RolloutConfig
from megatron_gspo.net import auth_headers, server_port
from megatron_gspo.platform.lifetime import parent_death_preexec

REPO_ROOT = Path(__file__).resolve().parents[3]
CPU_STUBS_DIR = Path(__file__).resolve().parents[2] / "platform" / "sglang_cpu_stubs"
"""SGLang's CPU import stand-ins (platform/sglang_cpu_stubs/README.md), a folder put on PYTHONPATH."""
SGLANG_PYTHON_ENV = "MEGATRON_GSPO_SGLANG_PYTHON"
BATCHED_ATTENTION_ENV = "MEGATRON_GSPO_SGLANG_BATCHED_ATTENTION"
"""Read by the CPU plugin (platform/sglang_cpu_stubs/megatron_gspo_sglang_cpu.py): "0" turns it off."""


def cpu_plugin(name: str = "megatron_gspo_sglang_cpu"):
    """The CPU servers' SGLang plugin module (platform/sglang_cpu_stubs/megatron_gspo_sglang_cpu.py) or one of
    the modules it installs (`name`), loaded from its folder for tests; the trainer itself never runs it."""
    spec = importlib.util.spec_from_file_location(name, CPU_STUBS_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def default_sglang_python() -> str:
    """$MEGATRON_GSPO_SGLANG_PYTHON, else .venv-sglang/bin/python of this checkout."""
    return os.environ.get(SGLANG_PYTHON_ENV) or str(REPO_ROOT / ".venv-sglang" / "bin" / "python")


def check_sglang_python(python: str) -> None:
    """ValueError unless the interpreter that launches SGLang exists."""
    if not Path(python).exists():
        raise ValueError(f"SGLang python {python!r} does not exist: run scripts/setup_sglang.sh "
                         f"or set ${SGLANG_PYTHON_ENV}")


_TORCHRUN_ENV = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT"}


class ServerStartError(RuntimeError):
    """A server exited or did not become ready; the message carries the tail of its log."""


@dataclass(frozen=True)
class ServerConfig:
    """How to launch one SGLang server (`python -m sglang.launch_server`): the run's rollout settings (every
    server setting a user may change is a `rollout.*` key, config.py) and what the launch itself decides."""

    model_path: str
    """Hugging Face model directory."""
    settings: RolloutConfig
    """concurrency (`--max-running-requests`), max_total_tokens, sleep_on_idle, overlap_schedule,
    cpu_batched_attention, server_args, server_startup_timeout_s and api_key of the run."""
    device: Literal["cpu", "cuda"]
    """"cpu" (import stand-ins + SGLANG_USE_CPU_ENGINE=1) or "cuda"."""
    dtype: str | None
    """Weights/activations dtype (`--dtype`, model.dtype); None: SGLang's "auto" (float32 checkpoints run
    in float16)."""
    python: str = field(default_factory=default_sglang_python)
    """Interpreter of the environment that has SGLang installed."""
    host: str = "127.0.0.1"
    """Address the HTTP server binds to (and the URL the client uses)."""
    weight_version: str | None = None
    """Initial weight version the server reports (`--weight-version`)."""
    return_routed_experts: bool = False
    """`--enable-return-routed-experts` (SGLang arg_groups/fields/exec_.py:158): record every token's MoE
    routing so requests can ask for it (gspo.routing_replay=rollout). MoE models only; it costs a pinned host
    buffer of 4 * L * k bytes per KV-cache token (state_capturer/base.py:68-72, sized by the KV pool:
    model_executor/model_runner.py:1233)."""
    log_dir: str | None = None
    """Where server logs go (one file per server); None: a fresh temporary folder."""
    extra_args: tuple[str, ...] = ()
    """`launch_server` arguments after the run's rollout.server_args (e.g. `megatron-gspo serve --sglang-args`)."""
    die_with_parent: bool = True
    """Linux: SIGKILL the server when the thread that started it exits (start it from a thread that
    lives as long as the server, e.g. the main thread). False: the server outlives its launcher."""

    def __post_init__(self):
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if not Path(self.model_path).is_dir():
            raise ValueError(f"model_path {self.model_path!r} is not a directory")
        check_sglang_python(self.python)

    @property
    def max_total_tokens(self) -> int | None:
        """rollout.max_total_tokens; unset: 16384 on CPU (SGLang's own would take ~70% of RAM), SGLang's own on CUDA."""
        if self.settings.max_total_tokens is not None:
            return self.settings.max_total_tokens
        return CPU_MAX_TOTAL_TOKENS if self.device == "cpu" else None


CPU_MAX_TOTAL_TOKENS = 16384
"""A CPU server's KV-cache tokens when rollout.max_total_tokens is unset."""


PORT_TAKEN = "address already in use"
"""What SGLang's HTTP server (uvicorn) logs when its port is taken."""


class SGLangServer:
    """One SGLang server subprocess. Use as a context manager, or start() / wait_ready() / stop()."""

    def __init__(self, config: ServerConfig, port: int | None = None, gpu_id: int | None = None):
        self.config = config
        self.port = port or server_port(config.host)
        self.gpu_id = gpu_id
        self.url = f"http://{config.host}:{self.port}"
        log_dir = Path(config.log_dir or tempfile.mkdtemp(prefix="sglang-logs-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"sglang-{self.port}.log"
        self.process: subprocess.Popen | None = None
        self.ready_after_s: float | None = None
        self._started_at = 0.0

    def command(self) -> list[str]:
        c, r = self.config, self.config.settings
        cmd = [c.python, "-m", "sglang.launch_server", "--model-path", c.model_path, "--host", c.host,
               "--port", str(self.port), "--device", c.device]
        optional = {"--max-total-tokens": c.max_total_tokens, "--max-running-requests": r.concurrency,
                    "--dtype": c.dtype, "--api-key": r.api_key, "--weight-version": c.weight_version}
        for flag, value in optional.items():
            if value is not None:
                cmd += [flag, str(value)]
        if r.sleep_on_idle:
            cmd.append("--sleep-on-idle")
        if c.return_routed_experts:
            cmd.append("--enable-return-routed-experts")
        if not (c.device == "cuda" if r.overlap_schedule is None else r.overlap_schedule):
            cmd.append("--disable-overlap-schedule")
        return cmd + list(r.server_args) + list(c.extra_args)

    def environment(self) -> dict[str, str]:
        # Launched from a torchrun rank, the server would inherit RANK/WORLD_SIZE/MASTER_PORT and
        # SGLang's own torch.distributed init would join the trainer's rendezvous and hang there.
        env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_ENV and not k.startswith("TORCHELASTIC_")}
        if self.config.device == "cpu":
            # CPU test scaffolding only: the import stand-ins (platform/sglang_cpu_stubs/README.md) and
            # the CPU engine.
            env["SGLANG_USE_CPU_ENGINE"] = "1"
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CPU_STUBS_DIR), env.get("PYTHONPATH")) if p)
            env[BATCHED_ATTENTION_ENV] = "1" if self.config.settings.cpu_batched_attention else "0"
        elif self.gpu_id is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(self.gpu_id)
        return env

    def start(self) -> "SGLangServer":
        if self.process is not None:
            raise RuntimeError(f"server {self.url} already started")
        with open(self.log_path, "ab") as log:
            # Own session = own process group: stop() signals SGLang's children too.
            die_with_parent = self.config.die_with_parent and sys.platform.startswith("linux")
            self.process = subprocess.Popen(self.command(), env=self.environment(), stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True,
                                            preexec_fn=parent_death_preexec() if die_with_parent else None)
        self._started_at = time.monotonic()
        return self

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_ready(self, timeout_s: float | None = None) -> float:
        """Poll /health_generate (a real one-token generation) until it answers 200; seconds since start."""
        if self.process is None:
            raise RuntimeError("start() the server first")
        deadline = self._started_at + (timeout_s or self.config.settings.server_startup_timeout_s)
        while True:
            code = self.process.poll()
            if code is not None:
                raise ServerStartError(f"SGLang server {self.url} exited with code {code} during start-up; "
                                       f"log {self.log_path}, last lines:\n{self.log_tail()}")
            if health_generate(self.url, self.config.settings.api_key, timeout_s=10):
                self.ready_after_s = time.monotonic() - self._started_at
                return self.ready_after_s
            if PORT_TAKEN in self.log_tail():  # SGLang then hangs in its shutdown instead of exiting
                raise ServerStartError(f"SGLang server {self.url}: port {self.port} was taken before the server "
                                       f"bound it ({PORT_TAKEN}); log {self.log_path}, last lines:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise ServerStartError(f"SGLang server {self.url} not ready after "
                                       f"{timeout_s or self.config.settings.server_startup_timeout_s:.0f} s; "
                                       f"log {self.log_path}, last lines:\n{self.log_tail()}")
            time.sleep(1.0)

    def kill(self) -> None:
        """SIGKILL the whole process group at once (tests: a server that dies mid-rollout)."""
        if self.process is not None and self.process.poll() is None:
            leftovers = shm_files_of_group(self.process.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            deadline = time.monotonic() + 5.0
            while _group_alive(self.process.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            remove_shm_files(leftovers)

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after grace_s; returns when all are gone, and
        the shared-memory files SGLang leaves behind are removed (`shm_files_of_group`)."""
        if self.process is None:
            return
        pgid = self.process.pid
        leftovers = shm_files_of_group(pgid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        # The launcher may be gone while a child still runs: wait on the group, not the PID.
        deadline = time.monotonic() + grace_s
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        self.process.wait()
        deadline = time.monotonic() + 5.0
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        remove_shm_files(leftovers)

    def __enter__(self) -> "SGLangServer":
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    """True while a live (not zombie) process of group pgid exists (Linux /proc)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # Fields after the ")" that closes the command name: state ppid pgrp ...
            state, _ppid, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue
        if int(pgrp) == pgid and state != "Z":
            return True
    return False


SHM_DIR = Path("/dev/shm")
LEAKED_SHM = ("sem.mp-", "sglang_loads_")
"""What an SGLang 0.5.23 server leaves in /dev/shm when it stops: its scheduler's load-snapshot file
(sglang/srt/managers/load_snapshot.py:303, never unlinked) and a multiprocessing semaphore of its
scheduler (unlinked by Python's resource tracker, which SGLang's shutdown kills: kill_process_tree)."""


def shm_files_of_group(pgid: int) -> dict[str, int]:
    """The /dev/shm files (name -> inode) named like LEAKED_SHM that processes of group pgid have mapped or
    open: this server's own, never another run's. /proc/PID/maps names a semaphore by the temporary name
    sem_open created it under, so files are matched by inode."""
    inodes = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            for line in (proc / "maps").read_text().splitlines():
                fields = line.split(maxsplit=5)  # address perms offset device inode path
                if len(fields) == 6 and fields[5].startswith(f"{SHM_DIR}/"):
                    inodes.add(int(fields[4]))
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd).startswith(f"{SHM_DIR}/"):
                    inodes.add(os.stat(fd).st_ino)
        except (OSError, IndexError, ValueError):  # gone meanwhile, or not ours to read
            continue
    found = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir(SHM_DIR):
            with contextlib.suppress(OSError):
                if entry.name.startswith(LEAKED_SHM) and entry.inode() in inodes:
                    found[entry.name] = entry.inode()
    return found


def remove_shm_files(files: dict[str, int]) -> None:
    """Unlink each file of `shm_files_of_group` that still has its inode (once its processes are gone)."""
    for name, inode in files.items():
        path = SHM_DIR / name
        with contextlib.suppress(OSError):
            if path.stat().st_ino == inode:
                path.unlink()


def health_generate(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> bool:
    """True when GET /health_generate answers 200 (SGLang runs a one-token generation for it)."""
    req = urllib.request.Request(f"{url}/health_generate", headers=auth_headers(api_key))
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def get_json(url: str, path: str, api_key: str | None = None, timeout_s: float = 10.0) -> dict:
    req = urllib.request.Request(f"{url}{path}", headers=auth_headers(api_key))
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def start_servers(config: ServerConfig, num_servers: int = 1, gpu_ids: list[int] | None = None) -> list[SGLangServer]:
    """Start `num_servers` servers without waiting for them (their ~10-20 s start-up can overlap other
    work); then `wait_all_ready`, and `stop_all` in the end."""
    if num_servers < 1:
        raise ValueError(f"num_servers must be >= 1, got {num_servers}")
    servers = [SGLangServer(config, gpu_id=None if gpu_ids is None else gpu_ids[i]) for i in range(num_servers)]
    try:
        for server in servers:
            server.start()
    except BaseException:
        stop_all(servers)
        raise
    return servers


def wait_all_ready(servers: list[SGLangServer]) -> None:
    """Wait for every server in parallel; the first failure raises (naming the server and its log tail)."""
    with ThreadPoolExecutor(len(servers)) as pool:
        for future in [pool.submit(s.wait_ready) for s in servers]:
            future.result()


def stop_all(servers: list[SGLangServer]) -> None:
    with ThreadPoolExecutor(max(len(servers), 1)) as pool:
        list(pool.map(SGLangServer.stop, servers))


@contextlib.contextmanager
def launch_servers(config: ServerConfig, num_servers: int = 1,
                   gpu_ids: list[int] | None = None) -> Iterator[list[SGLangServer]]:
    """Start `num_servers` servers in parallel, wait until all are ready, stop all on exit.

    If any server fails to start, all are stopped and the error names the server and its log tail.
    """
    servers = start_servers(config, num_servers, gpu_ids)
    try:
        wait_all_ready(servers)
        yield servers
    finally:
        stop_all(servers)
