"""Server management without SGLang: start-up failures carry the log tail; stop leaves no process."""
import dataclasses
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_gspo.config import RolloutConfig
from megatron_gspo.rollout.sglang.server import CPU_STUBS_DIR, ServerConfig, ServerStartError, SGLangServer, _group_alive


def fake_python(tmp_path, body: str) -> str:
    """An executable standing in for the SGLang interpreter."""
    path = tmp_path / "python"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_command_and_cpu_environment(tmp_path):
    config = ServerConfig(model_path=str(tmp_path), settings=RolloutConfig(api_key="k"), device="cpu", dtype="float32",
                          python=sys.executable, log_dir=str(tmp_path))
    server = SGLangServer(config, port=12345)
    cmd = server.command()
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    for flag, value in [("--port", "12345"), ("--device", "cpu"), ("--max-total-tokens", "16384"),
                        ("--api-key", "k"), ("--dtype", "float32"), ("--host", "127.0.0.1")]:
        assert cmd[cmd.index(flag) + 1] == value
    assert "--disable-overlap-schedule" in cmd  # CPU default: nothing to overlap with
    cuda = SGLangServer(dataclasses.replace(config, device="cuda"), port=1).command()
    forced = SGLangServer(dataclasses.replace(config, settings=RolloutConfig(overlap_schedule=True)), port=1).command()
    assert "--disable-overlap-schedule" not in cuda and "--disable-overlap-schedule" not in forced
    env = server.environment()
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    stubs = Path(env["PYTHONPATH"].split(os.pathsep)[0])  # the import stand-ins come first
    assert (stubs / "sgl_kernel" / "__init__.py").is_file() and (stubs / "torchvision" / "__init__.py").is_file()


def test_every_server_setting_comes_from_the_rollout_config(tmp_path):
    def launched(device="cpu", **settings):
        config = ServerConfig(model_path=str(tmp_path), settings=RolloutConfig(**settings), device=device, dtype=None,
                              python=sys.executable, log_dir=str(tmp_path), extra_args=("--extra",))
        server = SGLangServer(config, port=1)
        return server.command(), server.environment()
    cmd, env = launched()
    assert cmd[cmd.index("--max-running-requests") + 1] == str(RolloutConfig().concurrency)
    assert "--sleep-on-idle" in cmd and env["MEGATRON_GSPO_SGLANG_BATCHED_ATTENTION"] == "1"
    cmd, env = launched(sleep_on_idle=False, cpu_batched_attention=False, concurrency=7, max_total_tokens=999,
                        server_args=("--a", "1"))
    assert "--sleep-on-idle" not in cmd and env["MEGATRON_GSPO_SGLANG_BATCHED_ATTENTION"] == "0"
    assert cmd[cmd.index("--max-running-requests") + 1] == "7" and cmd[cmd.index("--max-total-tokens") + 1] == "999"
    assert cmd[-3:] == ["--a", "1", "--extra"]          # the config's server_args, then the launch's own
    cuda, _ = launched(device="cuda")
    assert "--max-total-tokens" not in cuda             # SGLang's own KV-cache size on CUDA


def test_a_runs_servers_follow_its_config(tmp_path):
    from megatron_gspo.config import load_config
    from megatron_gspo.rollout.sglang.backend import server_config

    (tmp_path / "hf").mkdir()
    base = [f"model.hf_path={tmp_path / 'hf'}", "model.dtype=float32", f"logging.run_dir={tmp_path / 'run'}"]
    tiny = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"
    config = server_config(load_config(tiny, base))
    assert (config.dtype, config.return_routed_experts, config.weight_version) == ("float32", False, "0")
    assert config.log_dir == str(tmp_path / "run" / "sglang_logs")
    assert server_config(load_config(tiny, [*base, "rollout.server_dtype=bfloat16"])).dtype == "bfloat16"


def test_server_that_exits_reports_its_log_tail(tmp_path):
    python = fake_python(tmp_path, 'echo "RuntimeError: model is broken"; exit 3\n')
    server = SGLangServer(ServerConfig(model_path=str(tmp_path), settings=RolloutConfig(), device="cpu", dtype=None,
                                       python=python, log_dir=str(tmp_path)))
    server.start()
    with pytest.raises(ServerStartError, match=r"exited with code 3(.|\n)*model is broken"):
        server.wait_ready(timeout_s=20)
    server.stop()


def test_a_taken_port_fails_at_once_not_after_the_start_up_timeout(tmp_path):
    """SGLang's HTTP server logs the bind error and then hangs in its shutdown instead of exiting."""
    python = fake_python(tmp_path, 'echo "ERROR:    [Errno 98] error while attempting to bind on address '
                                   '(\'127.0.0.1\', 1): address already in use"\nexec sleep 300\n')
    server = SGLangServer(ServerConfig(model_path=str(tmp_path), settings=RolloutConfig(), device="cpu", dtype=None,
                                       python=python, log_dir=str(tmp_path)))
    server.start()
    start = time.monotonic()
    with pytest.raises(ServerStartError, match=f"port {server.port} was taken"):
        server.wait_ready(timeout_s=120)
    assert time.monotonic() - start < 30
    server.stop()


def test_server_ports_are_free_and_outside_the_ephemeral_range():
    """The OS hands ephemeral ports to other sockets (bind(0), outgoing connections) at any time; a port
    below that range stays free until the server binds it, unless someone binds it by number."""
    import random

    from megatron_gspo.net import ephemeral_port_range, server_port
    low, _ = ephemeral_port_range()
    ports = {server_port(rng=random.Random(seed)) for seed in range(20)}
    assert len(ports) > 10 and all(20000 <= p < low for p in ports), (low, sorted(ports))
    with socket.socket() as taken:  # a port in use is never returned
        taken.bind(("127.0.0.1", min(ports)))
        taken.listen()
        again = {server_port(rng=random.Random(seed)) for seed in range(20)}
        assert min(ports) not in again


def test_server_never_ready_times_out_and_stop_kills_the_whole_group(tmp_path):
    # A launcher that ignores SIGTERM and leaves a child behind: stop() must still clean up both.
    python = fake_python(tmp_path, "trap '' TERM\nsleep 300 &\necho started\nwait\n")
    server = SGLangServer(ServerConfig(model_path=str(tmp_path), settings=RolloutConfig(), device="cpu", dtype=None,
                                       python=python, log_dir=str(tmp_path)))
    server.start()
    with pytest.raises(ServerStartError, match=r"not ready after 2 s(.|\n)*started"):
        server.wait_ready(timeout_s=2)
    pgid = server.process.pid
    assert _group_alive(pgid)
    start = time.monotonic()
    server.stop(grace_s=1.0)
    assert not _group_alive(pgid)
    assert time.monotonic() - start < 8


LAUNCHER = """
import sys, time
from megatron_gspo.rollout.sglang.server import ServerConfig, SGLangServer
from megatron_gspo.config import RolloutConfig
server = SGLangServer(ServerConfig(model_path=sys.argv[1], settings=RolloutConfig(), device="cpu", dtype=None,
                                   python=sys.argv[2], log_dir=sys.argv[1], die_with_parent=sys.argv[3] == "1")).start()
print(server.process.pid, flush=True)
time.sleep(300)
"""


@pytest.mark.parametrize("die_with_parent", [True, False])
def test_a_killed_launcher_takes_its_server_along(tmp_path, die_with_parent):
    # The trainer's rank 0 SIGKILLed (OOM, scancel -s KILL): its server must not live on as an orphan.
    python = fake_python(tmp_path, "exec sleep 300\n")
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path), python, str(int(die_with_parent))],
                                stdout=subprocess.PIPE, text=True)
    server_pid = int(launcher.stdout.readline())
    assert _group_alive(server_pid)
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 5
    while _group_alive(server_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert _group_alive(server_pid) is not die_with_parent
    finally:
        if _group_alive(server_pid):
            os.killpg(server_pid, signal.SIGKILL)


def test_missing_sglang_python_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="setup_sglang.sh"):
        ServerConfig(model_path=str(tmp_path), settings=RolloutConfig(), device="cpu", dtype=None,
                     python=str(tmp_path / "nope"))


def test_cpu_stub_assign_req_to_token_pool(monkeypatch):
    """The one stand-in written in plain torch: request i's KV slots are the i-th run of out_cache_loc."""
    monkeypatch.syspath_prepend(str(CPU_STUBS_DIR))
    for name in [m for m in sys.modules if m == "sgl_kernel" or m.startswith("sgl_kernel.")]:
        monkeypatch.delitem(sys.modules, name)
    import sgl_kernel
    req_to_token = torch.zeros(3, 6, dtype=torch.int32)
    # request in pool row 2 gets slots [10, 11] at positions 1..2; row 0 gets [20, 21, 22] at 3..5
    sgl_kernel.assign_req_to_token_pool_cpu(torch.tensor([2, 0]), req_to_token, torch.tensor([1, 3]),
                                            torch.tensor([3, 6]), torch.tensor([10, 11, 20, 21, 22]), 6)
    assert req_to_token.tolist() == [[0, 0, 0, 20, 21, 22], [0] * 6, [0, 10, 11, 0, 0, 0]]
    with pytest.raises(NotImplementedError, match="CPU import stand-in"):
        sgl_kernel.verify_tree_greedy_cpu()
    for name in [m for m in sys.modules if m == "sgl_kernel" or m.startswith("sgl_kernel.")]:
        del sys.modules[name]


FAKE_SGLANG_SHM = """
import mmap, multiprocessing, os, signal, time
from multiprocessing import resource_tracker

lock = multiprocessing.get_context("spawn").Lock()  # /dev/shm/sem.mp-*: the resource tracker would unlink it
path = f"/dev/shm/sglang_loads_fake{os.getpid()}_0.shm"
fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096)
snapshot = mmap.mmap(fd, 4096)  # never unlinked, as SGLang's load snapshot


def shutdown(*_):  # as SGLang's: SIGKILL to its children (the resource tracker among them), then exit
    os.kill(resource_tracker._resource_tracker._pid, signal.SIGKILL)
    os._exit(0)


signal.signal(signal.SIGTERM, shutdown)
print("up", lock._semlock.name, path, flush=True)
time.sleep(300)
"""


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_stopping_a_server_removes_the_shared_memory_files_it_leaves_and_only_those(tmp_path, how):
    import multiprocessing

    (tmp_path / "fake_server.py").write_text(FAKE_SGLANG_SHM)
    python = fake_python(tmp_path, f"exec {sys.executable} {tmp_path / 'fake_server.py'}\n")
    server = SGLangServer(ServerConfig(model_path=str(tmp_path), settings=RolloutConfig(), device="cpu", dtype=None,
                                       python=python, log_dir=str(tmp_path))).start()
    # another run's: a semaphore of this process, a snapshot file nobody has open
    other_lock = multiprocessing.get_context("spawn").Lock()
    other_sem = Path(f"/dev/shm/sem.{other_lock._semlock.name[1:]}")  # "/mp-..."
    other_file = Path(f"/dev/shm/sglang_loads_other{os.getpid()}_0.shm")
    other_file.write_bytes(b"x")
    try:
        deadline = time.monotonic() + 60
        while "up" not in server.log_tail():
            assert server.process.poll() is None and time.monotonic() < deadline, server.log_tail()
            time.sleep(0.1)
        _, name, snapshot = server.log_tail().split()[-3:]
        sem, snapshot = Path(f"/dev/shm/sem.{name[1:]}"), Path(snapshot)
        assert sem.exists() and snapshot.exists() and other_sem.exists()
        server.stop(grace_s=5) if how == "stop" else server.kill()
        assert not _group_alive(server.process.pid)
        assert not sem.exists() and not snapshot.exists()
        assert other_sem.exists() and other_file.exists()
    finally:
        server.kill()
        other_file.unlink(missing_ok=True)
