"""The pieces multi-node jobs are made of, without SGLang: `serve` runs one server in the foreground until
SIGTERM, `wait-servers` waits for health, `train --nnodes` launches this node's share of the ranks."""
import http.server
import os
import re
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from megatron_gspo import cli
from megatron_gspo.rollout.sglang.serve import wait_for_servers
from megatron_gspo.net import free_port
from megatron_gspo.rollout.sglang.server import _group_alive
from tests.tiny_hf import fake_hf_dir

REPO = Path(__file__).resolve().parents[2]


def fake_sglang(tmp_path, lifetime_s: int | None = None) -> str:
    """An 'SGLang interpreter' whose launch_server is an HTTP server where /health_generate answers 200;
    it writes its PID to tmp_path/pid and, with lifetime_s, exits on its own (code 124) after that."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "health_generate").write_text("ok")
    limit = f"timeout {lifetime_s} " if lifetime_s else ""
    path = tmp_path / "python"
    path.write_text("#!/bin/sh\n"
                    'while [ $# -gt 0 ]; do [ "$1" = --port ] && port=$2; shift; done\n'
                    f"echo $$ > {tmp_path}/pid\n"
                    f'exec {limit}{sys.executable} -m http.server "$port" --bind 127.0.0.1 --directory {docs}\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


SERVE = """
import sys
from megatron_gspo.rollout.sglang.serve import serve
from megatron_gspo.rollout.sglang.server import ServerConfig
from megatron_gspo.config import RolloutConfig
sys.exit(serve(ServerConfig(model_path=sys.argv[1], settings=RolloutConfig(), device="cpu", dtype=None, python=sys.argv[2],
                            log_dir=sys.argv[1]), int(sys.argv[3])))
"""


def start_serve(tmp_path, python: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SERVE, str(tmp_path), python, str(free_port())],
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_serve_runs_until_sigterm_then_stops_its_server(tmp_path):
    proc = start_serve(tmp_path, fake_sglang(tmp_path))
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "ready on" in line:
                break
        assert "ready on" in lines[-1], "".join(lines)
        server_pid = int((tmp_path / "pid").read_text())
        assert _group_alive(server_pid) and proc.poll() is None  # still serving after it became ready
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert "SIGTERM: stopping the SGLang server" in out
    assert not _group_alive(server_pid)


def test_serve_fails_when_its_server_exits_by_itself(tmp_path):
    proc = start_serve(tmp_path, fake_sglang(tmp_path, lifetime_s=3))
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 124, out  # `timeout`'s code: the job step fails with the server's status
    assert "ready on" in out and "exited with code 124" in out


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health_generate" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_wait_for_servers_returns_when_all_answer_and_names_the_missing_one():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        up = f"http://127.0.0.1:{server.server_address[1]}"
        assert wait_for_servers([up], timeout_s=10) < 5
        down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        with pytest.raises(TimeoutError, match=down) as e:
            wait_for_servers([up, down], timeout_s=0.5, poll_s=0.1)
        assert up not in str(e.value)
    finally:
        server.shutdown()


@pytest.fixture
def train_args(tmp_path):
    fake_hf_dir(tmp_path / "hf")
    return [str(REPO / "examples/tiny_cpu.yaml"), f"model.hf_path={tmp_path / 'hf'}",  # TP2: world size 2
            f"logging.run_dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'run' / 'ckpt'}"]


@pytest.mark.parametrize("flags, error", [
    (["--nnodes", "3", "--master-port", "1234"], "--nnodes 3 must divide the world size tp\\*pp\\*cp\\*dp = 2"),
    (["--nnodes", "2"], "--master-port is required"),
    (["--nnodes", "2", "--node-rank", "2", "--master-port", "1234"], "--node-rank 2 must be in"),
    (["--nnodes", "2", "--nproc-per-node", "8", "--master-port", "1234"],  # 16 ranks at TP2: dp 8
     "2 node\\(s\\) x 8 ranks = 16, but tp\\*pp\\*cp\\*dp = 2: set parallel.dp=8"),
])
def test_train_multi_node_flags_are_checked(train_args, capsys, flags, error):
    assert cli.main(["train", *flags, *train_args]) == 1
    assert re.search(error, capsys.readouterr().err)


def test_train_runs_this_nodes_share_of_the_ranks(train_args, monkeypatch):
    from megatron_gspo.training import launch

    launched = {}
    monkeypatch.setattr(launch, "run_torchrun", lambda args, **_: launched.update(cmd=args) or 0)
    assert cli.main(["train", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1", "--master-addr", "n1",
                     "--master-port", "29123", *train_args]) == 0
    cmd = launched["cmd"]
    value = {flag: cmd[cmd.index(flag) + 1] for flag in ("--nproc-per-node", "--nnodes", "--node-rank",
                                                         "--master-addr", "--master-port")}
    assert value == {"--nproc-per-node": "1", "--nnodes": "2", "--node-rank": "1", "--master-addr": "n1",
                     "--master-port": "29123"}
    assert cmd[cmd.index("-m", cmd.index("--master-port")) + 1] == "megatron_gspo.training.loop"
    assert cmd[-len(train_args):] == train_args
