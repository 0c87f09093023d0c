"""docs/config.md, generated from config.py: every key with its type, default and docstring.

    megatron-gspo config --reference > docs/config.md     # what tests/unit/test_config_reference.py compares

The docstrings are the string literals that follow each field in config.py's dataclasses (read with `ast`,
as Python keeps no reference to them); the types and defaults come from the dataclasses themselves.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import typing
from pathlib import Path

from megatron_gspo import config as config_module
from megatron_gspo.config import TrainConfig

HEADER = """# Configuration reference

Every key of a training config (`megatron-gspo train CONFIG [key=value ...]`), section by section, with its
type, its default and what it does. Generated from `megatron_gspo/config.py` by
`megatron-gspo config --reference > docs/config.md`; a test fails when this page and the code disagree.
`megatron-gspo config CONFIG [key=value ...]` prints the configuration a `train` would run with.

YAML values and `key=value` overrides are parsed by the field's type: booleans `true`/`false`, `none` for an
optional value, lists as `[a, b]` (or `a,b` on the command line), mappings as `{key: value}`.
"""


def field_docs() -> dict[str, dict[str, str]]:
    """Class name -> field name -> the docstring written after the field in config.py."""
    tree = ast.parse(Path(inspect.getsourcefile(config_module)).read_text())
    docs: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            fields, body = {}, node.body
            for stmt, after in zip(body, body[1:] + [None]):
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) \
                        and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) \
                        and isinstance(after.value.value, str):
                    fields[stmt.target.id] = inspect.cleandoc(after.value.value)
            docs[node.name] = fields
    return docs


def _type_name(tp) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return " \\| ".join(str(a) for a in typing.get_args(tp))
    text = str(tp) if not isinstance(tp, type) else tp.__name__
    return text.replace("typing.", "").replace("|", "\\|")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if isinstance(value, tuple):
        value = list(value)
    return "`none`" if value is None else f"`{str(value).lower() if isinstance(value, bool) else value}`"


def reference_markdown() -> str:
    docs = field_docs()
    out = [HEADER]
    hints = typing.get_type_hints(TrainConfig)
    top = [f for f in dataclasses.fields(TrainConfig) if not dataclasses.is_dataclass(hints[f.name])]
    sections = [f for f in dataclasses.fields(TrainConfig) if dataclasses.is_dataclass(hints[f.name])]
    for section in sections:
        cls = hints[section.name]
        out.append(f"## `{section.name}`\n")
        intro = inspect.cleandoc(cls.__doc__ or "") if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "(") else ""
        out.append((intro or docs["TrainConfig"].get(section.name, "")) + "\n")
        out += _table(cls, docs.get(cls.__name__, {}), f"{section.name}.")
    out.append("## Top-level keys\n")
    out += _table(TrainConfig, docs["TrainConfig"], "", only=[f.name for f in top])
    return "\n".join(out).rstrip() + "\n"


def _table(cls, docs: dict[str, str], prefix: str, only: list[str] | None = None) -> list[str]:
    hints = typing.get_type_hints(cls)
    rows = ["| key | type | default | what it does |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(cls):
        if only is not None and f.name not in only:
            continue
        doc = " ".join(docs.get(f.name, "").split()).replace("|", "\\|")
        rows.append(f"| `{prefix}{f.name}` | {_type_name(hints[f.name])} | {_default(f)} | {doc} |")
    return rows + [""]
