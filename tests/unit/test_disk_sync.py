"""DiskSync refuses a weights folder SGLang's loader cannot find files in (it globs the folder)."""
import pytest

from megatron_gspo.rollout.sglang.weight_sync import DiskSync


@pytest.mark.parametrize("name", ["run[1]", "run*", "what?"])
def test_glob_characters_in_the_folder_are_refused(tmp_path, name):
    with pytest.raises(ValueError, match="glob character"):
        DiskSync(["http://127.0.0.1:1"], tmp_path / name / "weights", tmp_path)


def test_a_plain_folder_is_taken(tmp_path):
    assert DiskSync(["http://127.0.0.1:1"], tmp_path / "run-1" / "weights", tmp_path).folder.name == "weights"


@pytest.mark.parametrize("transport", ["disk", "tensor"])
def test_a_sync_keeps_one_connection_per_server_for_the_run(tmp_path, transport):
    """50 pushes to 2 servers over the run's HTTP clients: one connection each, all closed by close()
    (a client per push opened 50 per server and closed none)."""
    import asyncio
    import threading
    import time

    import torch

    from megatron_gspo.rollout.sglang.weight_sync import open_weight_sync
    from tests.unit.fake_sglang_server import FakeSGLang

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    servers = [asyncio.run_coroutine_threadsafe(FakeSGLang(name="0").__aenter__(), loop).result() for _ in range(2)]
    (tmp_path / "config.json").write_text("{}")
    try:
        sync = open_weight_sync(transport, [s.url for s in servers], folder=tmp_path / "weights", config_dir=tmp_path)
        for version in range(1, 51):
            sync.push([("w", torch.full((4,), float(version)))], str(version))
        assert [s.name for s in servers] == ["50", "50"]
        assert [s.connections for s in servers] == [1, 1]
        sync.close()
        deadline = time.monotonic() + 5
        while any(s._writers for s in servers) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not any(s._writers for s in servers), "close() left connections open"
    finally:
        for server in servers:
            loop.call_soon_threadsafe(server.kill)
        loop.call_soon_threadsafe(loop.stop)
