"""Pushing new weights from the trainer into SGLang servers: from disk, by tensor, by broadcast.

    sync = open_weight_sync("disk", urls, folder=run_dir / "weights", config_dir=hf_path)
    sync.push(named_tensors, version="7")     # every server now serves these weights as version "7"
    sync.close()

One protocol (`WeightSync`: push, close), three transports (`DiskSync`, `TensorSync`, `BroadcastSync`).

Input is an iterable of (Hugging Face name, full tensor), e.g. `convert.export.iter_hf_tensors(...)`
(one tensor per expert, q/k/v and gate/up separate: SGLang fuses them itself while loading). Every
server is updated directly (sglang_router does not forward these endpoints), each update is wrapped
in /begin_weight_update ... /end_weight_update, sets `weight_version`, and the version each server
reports afterwards is checked.

- disk: write an HF checkpoint folder the servers can read (shared file system), then
  /update_weights_from_disk. Simplest; costs a write and a read of the whole model.
- tensor: /update_weights_from_tensor with a ForkingPickler dump of [(name, tensor)], base64 in
  JSON. Meant for colocated servers: on CUDA the pickle carries IPC handles, on CPU shared-memory
  files (`file_system` sharing strategy; the default file-descriptor strategy crashes the server).
- broadcast: one gloo (CPU) / NCCL (GPU) group of the trainer (rank 0) and every server rank;
  per bucket, /update_weights_from_distributed announces names/dtypes/shapes and the trainer
  broadcasts the tensors in that order.
"""
from __future__ import annotations

import base64
import contextlib
import io
import json
import shutil
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Iterator, Literal, Protocol
from urllib.parse import urlsplit

import httpx
import torch
import torch.multiprocessing as mp
from safetensors.torch import save_file
import torch.distributed as dist

from megatron_gspo import profiling
from megatron_gspo.net import auth_headers, free_port, tls_context
from megatron_gspo.platform.torch_compat import standalone_group
from megatron_gspo.rollout.protocol import NamedTensors

DEFAULT_BUCKET_BYTES = 256 * 2**20


class WeightSyncError(RuntimeError):
    """A server refused or failed an update; the message names the server and endpoint."""


class WeightSync(Protocol):
    """How new weights reach the rollout servers. `push` consumes (HF name, full tensor) pairs in order
    and returns once every server reports `version`; `close` releases what the transport holds."""

    def push(self, named_tensors: NamedTensors, version: str) -> None: ...

    def close(self) -> None: ...


WeightSyncKind = Literal["disk", "tensor", "broadcast"]


def open_weight_sync(kind: WeightSyncKind, urls: list[str], *, folder: str | Path, config_dir: str | Path,
                     api_key: str | None = None, pause_generation: bool = False) -> WeightSync:
    """The transport `kind` to the servers at `urls` (connected: ready to push).

    disk writes to `folder` (a path the servers can read; config and tokenizer files come from
    `config_dir`); broadcast uses NCCL when this process has a GPU, else gloo. `pause_generation`: a push
    holds the requests in flight while the servers load (`generation_paused`) and they continue under the
    new weights (rollout.partial_rollout), instead of waiting for them to finish."""
    if kind == "disk":
        return DiskSync(urls, folder, config_dir, api_key=api_key, pause_generation=pause_generation)
    if kind == "tensor":
        return TensorSync(urls, api_key=api_key, pause_generation=pause_generation)
    if kind == "broadcast":
        # NCCL between GPUs (the exported tensors are on rank 0's GPU, SGLang's on theirs), else gloo.
        sync = BroadcastSync(urls, api_key=api_key, backend="nccl" if torch.cuda.is_available() else "gloo",
                             pause_generation=pause_generation)
        sync.connect()
        return sync
    raise ValueError(f"weight sync must be one of disk, tensor, broadcast, got {kind!r}")


class ServerAdmin:
    """Synchronous calls to one server's control endpoints."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        self._http = httpx.Client(headers=auth_headers(api_key), timeout=timeout_s, verify=tls_context())

    def post(self, path: str, payload: dict | None = None) -> dict:
        try:
            response = self._http.post(f"{self.url}{path}", json=payload or {})
        except httpx.TransportError as e:
            raise WeightSyncError(f"{self.url}{path}: {type(e).__name__}: {e}") from e
        try:
            body = response.json()
        except ValueError:
            body = {"message": response.text[:500]}
        if response.status_code != 200 or body.get("success") is False:
            raise WeightSyncError(f"{self.url}{path}: HTTP {response.status_code}: {body.get('message', body)}")
        return body

    def weight_version(self) -> str:
        response = self._http.get(f"{self.url}/get_model_info")
        response.raise_for_status()
        return response.json()["weight_version"]

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "ServerAdmin":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _admins(urls: list[str], api_key: str | None) -> list[ServerAdmin]:
    if not urls:
        raise ValueError("no server URLs given")
    return [ServerAdmin(u, api_key) for u in urls]


@contextlib.contextmanager
def connected(urls: list[str], api_key: str | None = None) -> Iterator[list[ServerAdmin]]:
    """One ServerAdmin per server for the block (its HTTP connection kept between calls), closed after it."""
    admins = _admins(urls, api_key)
    try:
        yield admins
    finally:
        for admin in admins:
            admin.close()


def _on_all(admins: list[ServerAdmin], fn) -> list:
    """Run fn(admin) for every server concurrently; re-raise the first failure."""
    with ThreadPoolExecutor(len(admins)) as pool:
        return [f.result() for f in [pool.submit(fn, a) for a in admins]]


def _update(admins: list[ServerAdmin], version: str, body, pause_generation: bool = False) -> None:
    """begin -> body(admin) on every server -> end, then check every server reports `version`.
    `pause_generation`: all of it with the requests in flight held (`generation_paused`), which then
    continue under the new weights; otherwise SGLang waits for them to finish before it loads."""
    with generation_paused(admins) if pause_generation else contextlib.nullcontext():
        _on_all(admins, lambda a: a.post("/begin_weight_update"))
        try:
            body()
        finally:
            _on_all(admins, lambda a: a.post("/end_weight_update"))
    wrong = {a.url: v for a in admins if (v := a.weight_version()) != version}
    if wrong:
        raise WeightSyncError(f"after the update to weight_version {version!r} servers report {wrong}")


@contextlib.contextmanager
def generation_paused(admins: list[ServerAdmin]) -> Iterator[None]:
    """Every server's requests in flight held inside the block: SGLang's /pause_generation in mode
    "retract" puts them back in its queue (their KV cache freed, so a weight update may flush the cache)
    and /continue_generation resumes them after it, their prompt and tokens so far prefilled again with
    the weights loaded meanwhile; a request that arrives meanwhile waits. Each answer then tells which
    output tokens which weights generated (meta_info.weight_versions; rollout/sglang/client.py:stale_prefix).
    The servers continue even when the block fails (a failed continue then does not hide its error)."""
    failed = True
    try:
        _on_all(admins, lambda a: a.post("/pause_generation", {"mode": "retract"}))
        yield
        failed = False
    finally:
        try:
            _on_all(admins, lambda a: a.post("/continue_generation", {}))
        except WeightSyncError:
            if not failed:
                raise


def buckets(named_tensors: NamedTensors, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of tensors of about bucket_bytes (a larger tensor forms its own bucket)."""
    bucket, size = [], 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


# ---------------------------------------------------------------------------------------- disk

def write_hf_checkpoint(named_tensors: NamedTensors, out_dir: str | Path, config_dir: str | Path,
                        shard_bytes: int = 2 * 2**30) -> Path:
    """Save tensors as safetensors shards (+ index) and copy config/tokenizer files from config_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    shards = list(buckets(named_tensors, shard_bytes))
    weight_map = {}
    for i, shard in enumerate(shards):
        file = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({name: t.detach().contiguous().cpu() for name, t in shard}, out / file, metadata={"format": "pt"})
        weight_map.update({name: file for name, _ in shard})
    if len(shards) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for src in Path(config_dir).iterdir():
        if src.is_file() and not src.name.startswith("model") and src.suffix in (".json", ".txt", ".model", ".jinja"):
            shutil.copy2(src, out / src.name)
    return out


def sync_from_disk(admins: list[ServerAdmin], checkpoint_dir: str | Path, version: str,
                   pause_generation: bool = False) -> None:
    """Every server loads the HF checkpoint at checkpoint_dir (a path the servers can read)."""
    payload = {"model_path": str(checkpoint_dir), "weight_version": version, "flush_cache": True}
    _update(admins, version, lambda: _on_all(admins, lambda a: a.post("/update_weights_from_disk", payload)),
            pause_generation)


def check_disk_sync_folder(folder: str | Path) -> None:
    """ValueError when SGLang's disk loader cannot find weights in `folder`: it globs the folder for
    *.safetensors, so a path with a glob character (*, ? or [) matches no file."""
    if any(c in str(Path(folder).resolve()) for c in "*?["):
        raise ValueError(f"weight sync folder {str(folder)!r} has a glob character (*, ? or [): SGLang's loader "
                         "globs the folder for *.safetensors and would find none")


class DiskSync:
    """WeightSync through a shared file system: an HF checkpoint in `folder`, loaded by every server."""

    def __init__(self, urls: list[str], folder: str | Path, config_dir: str | Path, api_key: str | None = None,
                 pause_generation: bool = False):
        check_disk_sync_folder(folder)
        self.folder, self.config_dir = Path(folder), config_dir
        self.admins = _admins(urls, api_key)
        """Held for the run: one HTTP connection per server, kept between pushes."""
        self.pause_generation = pause_generation
        """Hold the requests in flight while the servers load (not while the checkpoint is written)."""

    def push(self, named_tensors: NamedTensors, version: str) -> None:
        where = profiling.current()
        with profiling.span(f"{where}/write"):  # the export walk (gathering the tensors) happens in here
            written = write_hf_checkpoint(named_tensors, self.folder, self.config_dir)
        with profiling.span(f"{where}/server_load"):
            sync_from_disk(self.admins, written.resolve(), version, pause_generation=self.pause_generation)

    def close(self) -> None:
        for admin in self.admins:
            admin.close()


# -------------------------------------------------------------------------------------- tensor

def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """base64 of a ForkingPickler dump, what /update_weights_from_tensor unpickles per TP rank."""
    if not any(t.is_cuda for _, t in named):
        # CPU tensors travel as shared-memory files; the default (file descriptors) crashes the server.
        mp.set_sharing_strategy("file_system")
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump([(name, t.detach().contiguous()) for name, t in named])
    return base64.b64encode(buffer.getvalue()).decode()


def sync_by_tensor(admins: list[ServerAdmin], named_tensors: NamedTensors, version: str,
                   bucket_bytes: int = DEFAULT_BUCKET_BYTES, tp_size: int = 1, pause_generation: bool = False) -> None:
    """Colocated update: tensors are shared with each server process, not copied over HTTP."""

    def body():
        for bucket in buckets(named_tensors, bucket_bytes):
            payload = {"serialized_named_tensors": [serialize_named_tensors(bucket)] * tp_size,
                       "weight_version": version, "flush_cache": True}
            _on_all(admins, lambda a: a.post("/update_weights_from_tensor", payload))
    _update(admins, version, body, pause_generation)


class TensorSync:
    """WeightSync for servers on this host: tensors shared with the server processes, not copied."""

    def __init__(self, urls: list[str], api_key: str | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 pause_generation: bool = False):
        self.admins = _admins(urls, api_key)
        """Held for the run: one HTTP connection per server, kept between pushes."""
        self.bucket_bytes, self.pause_generation = bucket_bytes, pause_generation

    def push(self, named_tensors: NamedTensors, version: str) -> None:
        sync_by_tensor(self.admins, named_tensors, version, bucket_bytes=self.bucket_bytes,
                       pause_generation=self.pause_generation)

    def close(self) -> None:
        for admin in self.admins:
            admin.close()


# ----------------------------------------------------------------------------------- broadcast

def address_towards(url: str) -> str:
    """This host's IP address on the route to `url`'s host: what that host can reach us at. A UDP
    `connect` only asks the kernel for the route; nothing is sent. Falls back to the hostname."""
    parts = urlsplit(url)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((parts.hostname, parts.port or 80))
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostname()


class BroadcastSync:
    """Weight updates by broadcast from the trainer (rank 0) to every server.

    connect() once (every server joins one group; server i's ranks start at 1 + the TP sizes of the
    servers before it), then push() per update, close() at the end.
    """

    def __init__(self, urls: list[str], api_key: str | None = None, master_address: str | None = None,
                 master_port: int | None = None, backend: str = "gloo", tp_sizes: list[int] | None = None,
                 group_name: str = "megatron_gspo_weights", timeout_s: float = 600.0,
                 pause_generation: bool = False):
        self.admins = _admins(urls, api_key)
        self.pause_generation = pause_generation
        self.master_address = master_address or address_towards(urls[0])
        """Where the servers reach this process (the group's rank 0): default, this host's address on
        the route to the first server (127.0.0.1 for local servers, the node's own on a cluster)."""
        self.master_port = master_port or free_port(self.master_address)
        self.backend = backend
        self.tp_sizes = tp_sizes or [1] * len(urls)
        self.group_name = group_name
        self.timeout = timedelta(seconds=timeout_s)
        self.group = None

    def connect(self) -> None:
        world_size = 1 + sum(self.tp_sizes)
        offsets = [1 + sum(self.tp_sizes[:i]) for i in range(len(self.admins))]
        payloads = [{"master_address": self.master_address, "master_port": self.master_port, "rank_offset": off,
                     "world_size": world_size, "group_name": self.group_name, "backend": self.backend}
                    for off in offsets]
        # The servers block in /init_weights_update_group until rank 0 (us) joins: call them from threads.
        with ThreadPoolExecutor(len(self.admins)) as pool:
            futures = [pool.submit(a.post, "/init_weights_update_group", p) for a, p in zip(self.admins, payloads)]
            try:
                self.group = standalone_group(self.master_address, self.master_port, world_size, self.group_name,
                                              self.backend, self.timeout)
            finally:
                for f in futures:
                    f.result()

    def push(self, named_tensors: NamedTensors, version: str, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        if self.group is None:
            raise RuntimeError("call connect() first")

        def body():
            for bucket in buckets(named_tensors, bucket_bytes):
                payload = {"names": [n for n, _ in bucket], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                           "shapes": [list(t.shape) for _, t in bucket], "group_name": self.group_name,
                           "weight_version": version, "flush_cache": True}
                errors: list[BaseException] = []

                def announce():
                    try:
                        _on_all(self.admins, lambda a: a.post("/update_weights_from_distributed", payload))
                    except BaseException as e:  # re-raised below, after the broadcasts
                        errors.append(e)
                thread = threading.Thread(target=announce)
                thread.start()
                for _, tensor in bucket:  # in the announced order
                    self.group.broadcast(tensor.detach().contiguous(), 0).wait()
                thread.join()
                if errors:
                    raise errors[0]
        _update(self.admins, version, body, self.pause_generation)

    def close(self) -> None:
        if self.group is not None:
            _on_all(self.admins, lambda a: a.post("/destroy_weights_update_group", {"group_name": self.group_name}))
            dist.destroy_process_group(self.group)
            self.group = None
        for admin in self.admins:
            admin.close()
