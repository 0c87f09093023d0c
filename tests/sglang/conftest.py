"""One pair of real SGLang servers (CPU, float32) on a tiny Qwen3 made here, shared by this directory's
tests and stopped after the last of them (package scope), not at the end of the whole session. A training
run that does not need to own its server trains against the first one (`adopted_server`), which is put back
to the initial weights before and after it.

Needs .venv-sglang (scripts/setup_sglang.sh). The failover test kills the second server, so it runs
right after the last other test that uses the servers (see pytest_collection_modifyitems).
"""
from pathlib import Path

import pytest

from megatron_gspo.config import RolloutConfig
from megatron_gspo.dev.tiny_model import make_tiny_qwen3
from megatron_gspo.rollout.sglang.server import ServerConfig, launch_servers
from megatron_gspo.rollout.sglang.weight_sync import connected, sync_from_disk
from sglang_test_utils import API_KEY


def pytest_collection_modifyitems(config, items):
    killers = [item for item in items if item.get_closest_marker("kills_server")]
    rest = [item for item in items if not item.get_closest_marker("kills_server")]
    users = [n for n, item in enumerate(rest) if "servers" in getattr(item, "fixturenames", ())]
    at = users[-1] + 1 if users else len(rest)
    items[:] = rest[:at] + killers + rest[at:]


def pytest_configure(config):
    config.addinivalue_line("markers", "kills_server: stops one of the shared SGLang servers (runs last)")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="package")
def servers(tiny_model_dir, tmp_path_factory):
    config = ServerConfig(model_path=str(tiny_model_dir), settings=RolloutConfig(api_key=API_KEY, server_startup_timeout_s=240),
                          device="cpu", dtype="float32", log_dir=str(tmp_path_factory.mktemp("sglang_logs")))
    with launch_servers(config, num_servers=2) as servers:
        print(f"\nSGLang servers ready after {[round(s.ready_after_s, 1) for s in servers]} s")
        yield servers


@pytest.fixture
def adopted_server(servers, tiny_model_dir):
    """Overrides that make `megatron-gspo train` adopt the first shared server (rollout.server_urls) instead of
    starting its own (~a minute of CPU each): the server holds the initial weights as version "0", as a server
    the run started would, and gets them back after the run (as version "default", the fixture's own)."""
    def reset(version: str) -> None:
        with connected([servers[0].url], api_key=API_KEY) as admins:
            sync_from_disk(admins, Path(tiny_model_dir).resolve(), version)

    reset("0")
    yield [f"rollout.server_urls=[{servers[0].url}]", f"rollout.api_key={API_KEY}"]
    reset("default")


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
