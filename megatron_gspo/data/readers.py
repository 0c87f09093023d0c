"""Reading prompt files into rows (dicts): `.jsonl`/`.json` lines through pandas (why: _read_json_lines),
`.parquet` through pyarrow, directories written by `datasets.Dataset.save_to_disk` through
`datasets.load_from_disk`.

Rows are numbered from 0 in every message (the first line of a `.jsonl` file is row 0); a line that is
not JSON is named by its line number too (1-based, as editors count).
Columnar formats cannot tell an absent field from a null one, so both read as None here.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from megatron_gspo.data.errors import DataError
from megatron_gspo.paths import relative_path_note

_MISSING = object()
_JSON_SUFFIXES = (".jsonl", ".json")


def read_rows(path: str | Path) -> list[dict]:
    """All rows of one prompt file or save_to_disk directory, in file order; DataError if unreadable or empty."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"{p}: no such file or directory{relative_path_note(p)}")
    try:
        if p.is_dir():
            rows = _read_saved_dataset(p)
        elif p.suffix in _JSON_SUFFIXES:
            rows = _read_json_lines(p)
        elif p.suffix == ".parquet":
            import pyarrow.parquet as pq
            rows = pq.read_table(p).to_pylist()
        else:
            raise DataError(f"{p}: unknown prompt file type {p.suffix!r} (expected .jsonl, .json lines, "
                            ".parquet or a datasets.save_to_disk directory)")
    except DataError:
        raise
    except Exception as e:  # the library's own message, with the file it is about
        raise DataError(f"{p}: cannot read it: {type(e).__name__}: {e}") from e
    if not rows:
        raise DataError(f"{p}: no rows")
    return rows


def _read_json_lines(p: Path) -> list[dict]:
    """Rows of a JSON-lines file, each value exactly as written.

    Every line is first checked to be one JSON object (`_check_json_lines`). pandas with dtype=False then
    keeps every value as JSON gave it, row by row (a string "007" stays a string; an answer column may mix
    strings and numbers, a prompt column strings and message lists). pyarrow's JSON reader needs one type
    per column, and datasets 5.2 turns a mixed column into its Json feature, which decodes the string "007"
    to the number 7. A row missing a key reads as NaN there: dropped here.
    """
    import pandas as pd
    _check_json_lines(p)
    frame = pd.read_json(p, lines=True, dtype=False, precise_float=True)
    return [{k: v for k, v in row.items() if not (isinstance(v, float) and math.isnan(v))}
            for row in frame.to_dict("records")]


def _check_json_lines(p: Path) -> None:
    """DataError naming the line (1-based, as editors count) and the row (0-based; blank lines are skipped)
    of the first line that is not one JSON object. pandas' own parser accepts some invalid JSON (a trailing
    comma), and a truncated line reached it as "Column (/answer) changed from string to object in row 20"."""
    row = 0
    with open(p, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line.rstrip("\r\n"))  # an error at the end of the line is on this line
            except json.JSONDecodeError as e:
                raise DataError(f"{p} line {lineno} (row {row}): not valid JSON: {e.msg} (column {e.colno})") from None
            if not isinstance(value, dict):
                raise DataError(f"{p} line {lineno} (row {row}): expected a JSON object, got {type(value).__name__}")
            row += 1


def _read_saved_dataset(p: Path) -> list[dict]:
    import datasets
    ds = datasets.load_from_disk(str(p))
    if isinstance(ds, datasets.DatasetDict):
        raise DataError(f"{p}: a DatasetDict with splits {sorted(ds)}; give the directory of one split")
    return ds.to_list()


def get_key(row: dict, key: str, default: Any = _MISSING) -> Any:
    """`row[key]`, where a dotted key ("reward_model.ground_truth") walks into nested dicts.

    A key present as a whole (a column literally named "a.b") wins over the nested walk. Returns
    `default` when some part is absent; without a default, raises KeyError(key).
    """
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            if default is _MISSING:
                raise KeyError(key)
            return default
        value = value[part]
    return value
