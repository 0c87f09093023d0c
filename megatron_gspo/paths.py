"""Wording for paths a user gave (config files, command lines)."""
from __future__ import annotations

import os
from pathlib import Path


def relative_path_note(path: str | os.PathLike) -> str:
    """For an error about `path`: where a relative path that does not exist was looked for (the working
    directory, which a YAML file's relative paths are resolved against, not the file's own folder); ""
    for an absolute or existing path. Starts with "; " to end a message."""
    if Path(path).is_absolute() or Path(path).exists():
        return ""
    return f"; relative paths are resolved against the working directory, {os.getcwd()}"
