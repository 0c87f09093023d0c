"""The MoE routing SGLang used for a response, as `Sample.routed_experts` (gspo.routing_replay=rollout).

Shapes: T = P + R - 1 input positions (P prompt tokens, R response tokens), L layers, k experts per token.

What SGLang 0.5.23 sends (paths under site-packages/sglang/srt/), and why this module reads it so:
- The server records routing only when started with `--enable-return-routed-experts`
  (arg_groups/fields/exec_.py:158, the flag name from arg_groups/arg_utils.py:290). Without it no
  capturer exists (state_capturer/routed_experts.py:50) and `meta_info` has no `routed_experts` key,
  even when the request asks (managers/tokenizer_manager.py:2602).
- A request asks with `"return_routed_experts": true` (managers/io_struct.py:264). The flag is one bool
  for the whole request and is copied unchanged into each of the n samples of `sampling_params.n = G`
  and each prompt of a batch (io_struct.py:1001), so every sample of a group answers with its own routing.
- `routed_experts_start_len` (io_struct.py:266-268, default 0) skips leading positions; we never send it,
  so rows start at position 0 (the first prompt token).
- Rows: the scheduler reads positions [start_len, seqlen - 1) with seqlen = len(prompt) +
  len(output_ids_through_stop) (managers/scheduler_components/batch_result_processor.py:154-162,
  state_capturer/base.py:182-188): every position but the last response token, which is sampled and
  never fed back, exactly the T rows `Sample.routed_experts` holds. `output_ids` in the answer are the
  same `output_ids_through_stop` (scheduler_components/output_streamer.py:490): R is len(output_ids).
- Values: the host buffer is int32 [tokens, num_hidden_layers, num_experts_per_tok] (base.py:68-72,
  sizes from hf_text_config, routed_experts.py:72-73); layer `layer_id` of the model writes column
  `layer_id` (base.py:48-50), so axis 1 is in decoder-layer order, 0..L-1. Ids are logical expert ids:
  they are captured before EPLB's logical-to-physical remap (layers/moe/topk.py:2574 runs before the
  remap below it); fused shared-expert columns are cut off ([:topk_size], routed_experts.py:145-147).
  A dense (non-MoE) layer would leave its column at the buffer's initial zeros (base.py:75).
- Encoding: the detokenizer sends `base64(tensor.numpy().tobytes())` of that int32 [T, L, k] slice
  (managers/detokenizer_manager.py:432-448; tokenizer_manager.py:2604-2609 does the same when it gets a
  raw tensor) into `meta_info["routed_experts"]`: C order, native byte order (little-endian on the x86
  and ARM hosts SGLang runs on). SGLang's own reader is np.frombuffer(b64decode(s), int32) without a
  reshape (state_capturer/routed_experts.py:166-174).

Stored here as uint8 (<= 256 experts) or int16: 1 or 2 bytes per entry instead of 4 (+1/3 for base64).
"""
from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

META_KEY = "routed_experts"
"""Where SGLang puts the routing in a /generate answer's `meta_info` (tokenizer_manager.py:2609)."""
_WIRE_DTYPE = np.dtype("<i4")
"""SGLang's int32 host buffer (state_capturer/base.py:70), little-endian."""
_NUM_EXPERTS_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")
"""HF config names of the routed-expert count: Qwen3-MoE, DeepSeek, Mixtral."""


def routing_dtype(num_experts: int) -> np.dtype:
    """The smallest dtype `Sample.routed_experts` uses for ids 0..num_experts-1: uint8 up to 256 experts,
    else int16 (signed, as torch has no uint16 index type; enough for 32768 experts)."""
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= 32768:
        return np.dtype(np.int16)
    raise ValueError(f"num_experts={num_experts} does not fit int16 expert ids (at most 32768)")


def bytes_per_token(num_layers: int, topk: int, num_experts: int) -> int:
    """Bytes of `Sample.routed_experts` per input position: L * k * itemsize (e.g. Qwen3-30B-A3B:
    48 * 8 * 1 = 384). SGLang's answer carries 4 * L * k bytes per position, base64 (+1/3) on top."""
    return num_layers * topk * routing_dtype(num_experts).itemsize


@dataclass(frozen=True)
class RoutingSpec:
    """The routing layout of the served MoE model: what each position's [L, k] block must look like."""

    num_layers: int
    """L: the model's `num_hidden_layers` (every layer has a row, SGLang's buffer has one per layer)."""
    topk: int
    """k: `num_experts_per_tok`."""
    num_experts: int
    """Routed experts per layer: ids must be < this; picks the stored dtype."""

    def __post_init__(self):
        if self.num_layers < 1 or self.topk < 1 or self.topk > self.num_experts:
            raise ValueError(f"bad routing layout: num_layers={self.num_layers}, topk={self.topk}, "
                             f"num_experts={self.num_experts} (need L >= 1 and 1 <= k <= num_experts)")
        routing_dtype(self.num_experts)  # raises for more experts than int16 holds

    @property
    def dtype(self) -> np.dtype:
        return routing_dtype(self.num_experts)

    @property
    def bytes_per_token(self) -> int:
        return bytes_per_token(self.num_layers, self.topk, self.num_experts)

    @classmethod
    def from_hf_config(cls, model_dir: str | Path) -> "RoutingSpec":
        """Read L, k and the expert count from `model_dir/config.json` (its `text_config` when it has one,
        as SGLang reads hf_text_config)."""
        path = Path(model_dir) / "config.json"
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        config = config.get("text_config", config)
        num_experts = next((config[k] for k in _NUM_EXPERTS_KEYS if config.get(k)), None)
        missing = [name for name, value in (("num_hidden_layers", config.get("num_hidden_layers")),
                                            ("num_experts_per_tok", config.get("num_experts_per_tok")),
                                            ("/".join(_NUM_EXPERTS_KEYS), num_experts)) if not value]
        if missing:
            raise ValueError(f"{path}: not a MoE config, no {', '.join(missing)} (routing replay needs one)")
        return cls(num_layers=int(config["num_hidden_layers"]), topk=int(config["num_experts_per_tok"]),
                   num_experts=int(num_experts))


def decode_routed_experts(encoded, *, prompt_len: int, response_len: int, spec: RoutingSpec,
                          where: str = "routed_experts") -> np.ndarray:
    """SGLang's `meta_info["routed_experts"]` string -> the [P + R - 1, L, k] array of `Sample.routed_experts`.

    `where` starts every error message (e.g. "server URL, group 3, sample 1"). ValueError when the
    string is not base64 int32s, when its size is not a whole number of [L, k] blocks (another model?),
    when the position count is not P + R - 1, or when an id is outside 0..num_experts-1.

    One extra trailing position (P + R) is dropped rather than refused: it can only be the last response
    token, which no training row reads (its output is never predicted from). SGLang 0.5.23 does not send
    it (module docstring), so this only matters for a server that reads [0, seqlen) instead.
    """
    if not isinstance(encoded, str):
        raise ValueError(f"{where}: routed_experts is {type(encoded).__name__}, expected SGLang's base64 string")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{where}: routed_experts is not valid base64 ({e})") from None
    L, k = spec.num_layers, spec.topk
    block = _WIRE_DTYPE.itemsize * L * k
    if len(raw) % block:
        raise ValueError(f"{where}: routed_experts has {len(raw)} bytes, not a multiple of 4 * L * k = {block} "
                         f"(L={L} layers, k={k}: does the server run the model the trainer expects?)")
    positions = len(raw) // block
    expected = prompt_len + response_len - 1
    if positions not in (expected, expected + 1):
        raise ValueError(f"{where}: routed_experts covers {positions} positions, expected P + R - 1 = "
                         f"{prompt_len} + {response_len} - 1 = {expected}")
    ids = np.frombuffer(raw, dtype=_WIRE_DTYPE).reshape(positions, L, k)[:expected]
    bad = (ids < 0) | (ids >= spec.num_experts)
    if bad.any():
        pos, layer, slot = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{where}: routed_experts[{pos}, {layer}, {slot}] = {int(ids[pos, layer, slot])} is not "
                         f"an expert id (0..{spec.num_experts - 1}); {int(bad.sum())} such entries")
    return ids.astype(spec.dtype)


def encode_for_sglang_wire(ids_TLk: np.ndarray) -> str:
    """The inverse of `decode_routed_experts` (before trimming): SGLang's encoding of an [T, L, k] array
    (detokenizer_manager.py:443). For fakes and tests of the wire format."""
    return base64.b64encode(np.ascontiguousarray(ids_TLk, dtype=_WIRE_DTYPE).tobytes()).decode("ascii")
