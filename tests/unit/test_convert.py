"""HF <-> Megatron checkpoint conversion: the table, round trips, configs, and bad inputs.

Checkpoints are made by transformers (`save_pretrained`, tests/tiny_hf.py). Loading the converted
checkpoints into the real Megatron model, under parallel layouts, is tests/distributed/test_convert_load.py.
"""
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_hf import hf_logprobs, read_all, save_tiny  # noqa: E402

from megatron_gspo.convert import convert_hf_to_mcore, convert_mcore_to_hf, mapping, read_hf_config  # noqa: E402
from megatron_gspo.convert.hf_config import shape_from_hf_dict  # noqa: E402
from megatron_gspo.convert.safetensors_io import SafetensorsReader  # noqa: E402
from megatron_gspo.model.gpt import Qwen3Shape  # noqa: E402

CHECKPOINTS = {  # name: (kind, dtype, max_shard_size)
    "moe_fp32_sharded": ("moe", torch.float32, "100KB"),
    "moe_bf16": ("moe", torch.bfloat16, None),
    "dense_tied_bf16": ("dense_tied", torch.bfloat16, None),
}


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: save_tiny(root / name, kind, dtype, max_shard_size=shard)
            for name, (kind, dtype, shard) in CHECKPOINTS.items()}


def leftovers(directory: Path) -> list[str]:
    """Staging directories a converter left behind."""
    return [p.name for p in directory.iterdir() if ".incomplete" in p.name]


# --- The table --------------------------------------------------------------------------------

def test_fused_qkv_is_per_query_group():
    # 2 query groups, 2 query heads per group, head_dim 1, hidden 1: Megatron's fused rows are
    # group 0: q0 q1 k0 v0, group 1: q2 q3 k1 v1.
    shape = Qwen3Shape(vocab_size=8, hidden_size=1, num_layers=1, num_attention_heads=4, num_query_groups=2,
                       head_dim=1, ffn_hidden_size=2)
    q = torch.tensor([[10.], [11.], [12.], [13.]])
    k, v = torch.tensor([[20.], [21.]]), torch.tensor([[30.], [31.]])
    fused = mapping.fuse(shape, mapping.Layout.QKV, [q, k, v])
    assert fused.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    assert all(torch.equal(a, b) for a, b in zip(mapping.split(shape, mapping.Layout.QKV, fused), [q, k, v]))


def test_glu_is_gate_then_up():
    shape = Qwen3Shape(vocab_size=8, hidden_size=1, num_layers=1, num_attention_heads=1, num_query_groups=1,
                       head_dim=1, ffn_hidden_size=2)
    gate, up = torch.tensor([[1.], [2.]]), torch.tensor([[3.], [4.]])
    fused = mapping.fuse(shape, mapping.Layout.GLU, [gate, up])
    assert fused.flatten().tolist() == [1, 2, 3, 4]
    assert all(torch.equal(a, b) for a, b in zip(mapping.split(shape, mapping.Layout.GLU, fused), [gate, up]))


def test_table_covers_every_hf_tensor_once(hf):
    for name in CHECKPOINTS:
        shape = read_hf_config(hf[name])
        index = mapping.hf_index(shape)
        names = [n for item in mapping.items(shape) for n in item.hf_names]
        assert len(names) == len(set(names)) == len(index)
        assert set(index) == set(SafetensorsReader(hf[name]).tensors), name


# --- Round trips ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", CHECKPOINTS)
def test_round_trip_is_bitwise(hf, tmp_path, name):
    convert_hf_to_mcore(hf[name], tmp_path / "mcore", group_bytes=50_000, progress=False)
    assert (tmp_path / "mcore" / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert len(list((tmp_path / "mcore" / "release").glob("*.distcp"))) > 1
    convert_mcore_to_hf(tmp_path / "mcore", hf[name], tmp_path / "back", max_shard_bytes=60_000, progress=False)

    original, back = read_all(hf[name]), read_all(tmp_path / "back")
    assert sorted(original) == sorted(back)
    for key, tensor in original.items():
        assert back[key].dtype == tensor.dtype and back[key].shape == tensor.shape, key
        assert torch.equal(back[key].view(-1).view(torch.uint8), tensor.view(-1).view(torch.uint8)), key

    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in original.values())
    assert set(index["weight_map"]) == set(original)
    shards = sorted(p.name for p in (tmp_path / "back").glob("*.safetensors"))
    assert set(index["weight_map"].values()) == set(shards) and len(shards) > 1
    for copied in ("config.json", "generation_config.json"):
        assert (tmp_path / "back" / copied).read_bytes() == (hf[name] / copied).read_bytes()
    assert leftovers(tmp_path) == []


def test_round_trip_with_tensors_stored_in_any_order(hf, tmp_path):
    """HF checkpoints usually store each gate_proj right before its up_proj (fc1 is then written
    from the mapped file as it is); stored in reverse order, fc1 must be assembled, with the same result."""
    from megatron_gspo.convert.safetensors_io import ShardWriter

    reversed_dir = tmp_path / "reversed"
    reversed_dir.mkdir()
    shutil.copy(hf["moe_bf16"] / "config.json", reversed_dir)
    original = read_all(hf["moe_bf16"])
    names = sorted(original, reverse=True)
    writer = ShardWriter(reversed_dir / "model.safetensors", [(n, tuple(original[n].shape), original[n].dtype)
                                                              for n in names])
    for name in names:
        writer.write(name, original[name])
    writer.close()
    reader = SafetensorsReader(reversed_dir)
    gate, up = (f"model.layers.0.mlp.experts.0.{p}_proj.weight" for p in ("gate", "up"))
    assert reader.map((gate, up)) is None and reader.map((up, gate)) is not None

    convert_hf_to_mcore(reversed_dir, tmp_path / "mcore", progress=False)
    convert_mcore_to_hf(tmp_path / "mcore", reversed_dir, tmp_path / "back", progress=False)
    back = read_all(tmp_path / "back")
    assert sorted(back) == sorted(original)
    for key, tensor in original.items():
        assert torch.equal(back[key].view(-1).view(torch.uint8), tensor.view(-1).view(torch.uint8)), key


def test_exported_checkpoint_loads_in_transformers(hf, tmp_path):
    convert_hf_to_mcore(hf["moe_fp32_sharded"], tmp_path / "mcore", progress=False)
    convert_mcore_to_hf(tmp_path / "mcore", hf["moe_fp32_sharded"], tmp_path / "back", progress=False)
    tokens = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(hf_logprobs(tmp_path / "back", tokens), hf_logprobs(hf["moe_fp32_sharded"], tokens))


# --- config.json ------------------------------------------------------------------------------

V5_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
          "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
          "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
          "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}, "tie_word_embeddings": False,
          "attention_bias": False, "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 768,
          "num_local_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
          "use_sliding_window": False, "sliding_window": None, "hidden_act": "silu"}


def test_config_v4_and_v5_spellings_agree():
    v4 = dict(V5_MOE, num_experts=128, rope_theta=1000000.0)
    del v4["num_local_experts"], v4["rope_parameters"]
    shape = shape_from_hf_dict(V5_MOE)
    assert shape == shape_from_hf_dict(v4)
    assert (shape.num_experts, shape.head_dim, shape.rotary_base, shape.moe_router_topk) == (128, 128, 1e6, 8)
    assert shape.norm_topk_prob and not shape.tie_word_embeddings


def test_config_of_saved_checkpoints(hf):
    moe = read_hf_config(hf["moe_bf16"])
    assert (moe.num_experts, moe.moe_ffn_hidden_size, moe.head_dim, moe.num_query_groups) == (4, 48, 24, 2)
    assert (moe.rotary_base, moe.norm_eps, moe.norm_topk_prob) == (1e6, 1e-5, True)
    dense = read_hf_config(hf["dense_tied_bf16"])
    assert not dense.is_moe and dense.tie_word_embeddings and dense.ffn_hidden_size == 128


@pytest.mark.parametrize("field,value", [
    ("mlp_only_layers", [1]), ("attention_bias", True), ("decoder_sparse_step", 2),
    ("use_sliding_window", True), ("architectures", ["LlamaForCausalLM"]), ("hidden_act", "gelu"),
    ("rope_parameters", {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0}),
])
def test_unrepresentable_config_is_refused_before_writing(hf, tmp_path, field, value):
    src = tmp_path / "hf"
    shutil.copytree(hf["moe_bf16"], src)
    config = json.loads((src / "config.json").read_text())
    config[field] = value
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=field) as error:
        convert_hf_to_mcore(src, tmp_path / "out", progress=False)
    assert str(src / "config.json") in str(error.value)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


# --- Bad inputs: a clear error naming the culprit, and nothing left behind ----------------------

def _rewrite(src: Path, change) -> None:
    from safetensors.torch import save_file

    tensors = read_all(src)
    change(tensors)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})


def test_missing_tensor(hf, tmp_path):
    src = tmp_path / "hf"
    shutil.copytree(hf["moe_bf16"], src)
    _rewrite(src, lambda t: t.pop("model.layers.1.mlp.experts.2.up_proj.weight"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight.*missing"):
        convert_hf_to_mcore(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_wrong_shape(hf, tmp_path):
    src = tmp_path / "hf"
    shutil.copytree(hf["moe_bf16"], src)
    name = "model.layers.0.self_attn.k_proj.weight"
    _rewrite(src, lambda t: t.update({name: t[name][:24]}))
    with pytest.raises(ValueError, match=rf"{name}.*shape \(24, 64\).*\(48, 64\)"):
        convert_hf_to_mcore(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_truncated_safetensors(hf, tmp_path):
    src = tmp_path / "hf"
    shutil.copytree(hf["moe_bf16"], src)
    file = src / "model.safetensors"
    os.truncate(file, file.stat().st_size - 100)
    with pytest.raises(ValueError, match=rf"{file}: truncated"):
        convert_hf_to_mcore(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("damage", ["truncated", "cut_to_its_header", "overwritten", "metadata_truncated"])
def test_damaged_torch_dist_checkpoint_names_the_file(hf, tmp_path, damage):
    convert_hf_to_mcore(hf["moe_bf16"], tmp_path / "mcore", group_bytes=50_000, progress=False)
    directory = tmp_path / "mcore" / "release"
    data = directory / "__3_0.distcp"  # one of the 12 data files (groups of 50 kB)
    size = data.stat().st_size
    if damage == "truncated":  # torch: "PytorchStreamReader failed reading zip archive", naming no file
        os.truncate(data, size - 100)
        message = (rf"{data}: truncated torch_dist data file \({size - 100} bytes, but .metadata has records up to "
                   rf"byte {size}\)")
    elif damage == "cut_to_its_header":
        os.truncate(data, 100)
        message = rf"{data}: truncated torch_dist data file \(100 bytes"
    elif damage == "overwritten":  # the right size, not a torch.save record
        data.write_bytes(bytes(size))
        message = rf"{data}: corrupt torch_dist data file: the record of '.*' cannot be read \(UnpicklingError: "
    else:
        os.truncate(directory / ".metadata", 1000)
        message = rf"{directory / '.metadata'}: truncated or corrupt \("
    with pytest.raises(ValueError, match=message):
        convert_mcore_to_hf(tmp_path / "mcore", hf["moe_bf16"], tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_existing_output_directory_is_refused(hf, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("mine")
    with pytest.raises(FileExistsError, match=str(tmp_path / "out")):
        convert_hf_to_mcore(hf["moe_bf16"], tmp_path / "out", progress=False)
    convert_hf_to_mcore(hf["moe_bf16"], tmp_path / "mcore", progress=False)
    with pytest.raises(FileExistsError, match=str(tmp_path / "out")):
        convert_mcore_to_hf(tmp_path / "mcore", hf["moe_bf16"], tmp_path / "out", progress=False)
    assert (tmp_path / "out" / "keep").read_text() == "mine"


def test_failure_midway_leaves_nothing(hf, tmp_path, monkeypatch):
    reads = []

    def failing(original):  # the 20th access to tensor data, whether copied (read) or mapped (map)
        def access(self, names, *args, **kwargs):
            reads.append(names)
            if len(reads) == 20:
                raise OSError(f"disk error reading {names}")
            return original(self, names, *args, **kwargs)
        return access

    for method in ("read", "map"):
        monkeypatch.setattr(SafetensorsReader, method, failing(getattr(SafetensorsReader, method)))
    with pytest.raises(OSError, match="disk error"):
        convert_hf_to_mcore(hf["moe_bf16"], tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_export_refuses_a_checkpoint_of_another_shape(hf, tmp_path):
    convert_hf_to_mcore(hf["moe_bf16"], tmp_path / "mcore", progress=False)
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    config = json.loads((hf["moe_bf16"] / "config.json").read_text())
    (config_dir / "config.json").write_text(json.dumps(dict(config, moe_intermediate_size=64)))
    with pytest.raises(ValueError, match="linear_fc1.weight is stored as"):
        convert_mcore_to_hf(tmp_path / "mcore", config_dir, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []
