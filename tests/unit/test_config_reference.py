"""docs/config.md is the reference generated from config.py: it must match the code, and every key has a docstring."""
import dataclasses
import typing
from pathlib import Path

from megatron_gspo.config import TrainConfig
from megatron_gspo.config_reference import field_docs, reference_markdown

PAGE = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_the_config_page_is_up_to_date():
    assert PAGE.read_text() == reference_markdown(), (
        "docs/config.md differs from config.py: regenerate it with `megatron-gspo config --reference > docs/config.md`")


def test_every_key_is_documented():
    docs = field_docs()
    hints = typing.get_type_hints(TrainConfig)
    classes = [TrainConfig, *(hints[f.name] for f in dataclasses.fields(TrainConfig) if dataclasses.is_dataclass(hints[f.name]))]
    missing = [f"{cls.__name__}.{f.name}" for cls in classes for f in dataclasses.fields(cls)
               if not docs.get(cls.__name__, {}).get(f.name)]
    assert not missing, f"config fields without a docstring: {missing}"
