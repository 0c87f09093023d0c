"""TrainConfig -> the trainer's settings (the model building itself runs in the distributed tests)."""
from pathlib import Path

from megatron_gspo.config import load_config
from megatron_gspo.model.presets import PRESETS
from megatron_gspo.training.setup import model_shape, step_settings

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"


def test_step_settings_follow_the_config():
    config = load_config(TINY, ["gspo.algorithm=grpo", "sampling.temperature=0.7", "gspo.old_logprobs=rollout",
                                "parallel.max_tokens_per_microbatch=1024", "gspo.eps_high=0.3", "gspo.num_minibatches=4"])
    settings = step_settings(config, PRESETS["tiny_dense"])
    assert (settings.loss.algorithm, settings.loss.eps_low, settings.loss.eps_high) == ("grpo", 0.2, 0.3)
    assert settings.loss.temperature == 0.7 and settings.loss.vocab_size == 500
    assert settings.num_minibatches == 4 and settings.max_tokens_per_microbatch == 1024


def test_shape_from_preset_or_hf_config(tmp_path):
    config = load_config(TINY, ["model.hf_path=none", "model.preset=tiny_moe", "rollout.backend=megatron"])
    assert model_shape(config) == PRESETS["tiny_moe"]
