"""The tiny local Qwen3 (megatron_gspo/dev/tiny_model.py): the spec reaches the config, and the files repeat."""
from transformers import AutoConfig, AutoTokenizer, Qwen3Config, Qwen3MoeConfig

from megatron_gspo.dev.tiny_model import EOS_TOKEN, TinyQwen3Spec, make_tiny_qwen3, tiny_qwen3_config


def test_every_size_field_reaches_the_transformers_config():
    spec = TinyQwen3Spec(vocab_size=300, hidden_size=32, num_layers=3, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=24, intermediate_size=40, max_position_embeddings=256, initializer_range=0.05,
                         tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=1e6)
    config = tiny_qwen3_config(spec, eos_token_id=7)
    assert type(config) is Qwen3Config
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, config.intermediate_size, config.max_position_embeddings,
            config.initializer_range, config.tie_word_embeddings, config.rms_norm_eps,
            config.rope_parameters["rope_theta"], config.eos_token_id) == (
        300, 32, 3, 2, 1, 24, 40, 256, 0.05, True, 1e-5, 1e6, 7)

    moe = tiny_qwen3_config(TinyQwen3Spec(num_experts=4, num_experts_per_tok=1, moe_intermediate_size=8,
                                          norm_topk_prob=False))
    assert type(moe) is Qwen3MoeConfig
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size, moe.norm_topk_prob) == (4, 1, 8, False)


def test_same_spec_same_files_and_a_tokenizer_for_arithmetic(tmp_path):
    spec = TinyQwen3Spec(seed=7)
    a, b = make_tiny_qwen3(tmp_path / "a", spec), make_tiny_qwen3(tmp_path / "b", spec)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    tok = AutoTokenizer.from_pretrained(a)
    assert tok.eos_token == tok.pad_token == EOS_TOKEN and tok.eos_token_id == 0  # the one special token
    assert tok.decode(tok("12+7=19")["input_ids"]) == "12+7=19"
    config = AutoConfig.from_pretrained(a)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (0, 0, 0)
    assert len(tok) <= config.vocab_size == spec.vocab_size


def test_a_non_empty_output_directory_is_refused(tmp_path, capsys):
    from megatron_gspo import cli

    out = tmp_path / "hf"
    out.mkdir()
    (out / "model-00001-of-00002.safetensors").write_text("an earlier, sharded model")
    assert cli.main(["tiny-model", str(out)]) == 1
    assert capsys.readouterr().err.strip() == (f"megatron-gspo tiny-model: error: output directory {out} already "
                                               "exists and is not empty; refusing to overwrite it")
    assert [p.name for p in out.iterdir()] == ["model-00001-of-00002.safetensors"]  # nothing written
    (out / "model-00001-of-00002.safetensors").unlink()
    assert cli.main(["tiny-model", str(out)]) == 0  # an empty directory is used
    assert (out / "model.safetensors").is_file()
