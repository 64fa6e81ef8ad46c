"""Typed user settings from `config.toml`.

The file is read with tomllib and written with tomli-w. Only known keys are interpreted; the
`[models.*]` tables belong to the model catalog (`npuchat.engine.catalog`) and are kept as they
are when settings are saved. A file that cannot be parsed is an error naming the file and line,
never silently replaced.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import tomli_w

from npuchat.engine.devices import DEVICE_CHOICES
from npuchat.engine.errors import NpuchatError

DEFAULT_MODEL = "qwen2.5-coder-1.5b"


@dataclass
class Settings:
    """What the user can set.

    `draft`: "lookup" (the default: prompt-lookup drafts cost nothing and speculation is exact,
    so it can only help), "default" (the catalog's draft model plus lookup), a model name, or
    empty / "none" for plain decoding.
    """

    model: str = DEFAULT_MODEL
    draft: str = "lookup"
    device: str = "auto"
    draft_device: str = ""
    threads: int = 0
    theme: str = "npuchat-dark"
    system_prompt: str = "You are a helpful assistant."
    show_metrics: bool = True
    cursor_blink: bool = True
    keymap: dict[str, str] = field(default_factory=dict)
    soc_model: int = 60
    htp_arch: int = 73

    def validate(self, source: str) -> None:
        for name in ("device", "draft_device"):
            value = getattr(self, name)
            if value and value not in DEVICE_CHOICES:
                raise NpuchatError(
                    f"{source}: {name} = {value!r} is not one of {', '.join(DEVICE_CHOICES)}"
                )
        if self.threads < 0:
            raise NpuchatError(f"{source}: threads must be 0 (auto) or a positive number")


def read_toml(path: Path) -> dict[str, Any]:
    """Parse a TOML file; a missing file is an empty table, a broken one a one-line error."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        return {}
    except tomllib.TOMLDecodeError as exc:
        raise NpuchatError(f"{path} is not valid TOML ({exc}); fix or remove that line") from exc


def write_toml(path: Path, data: dict[str, Any]) -> None:
    """Write TOML atomically (temp file + rename) so a crash never leaves half a config."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        tomli_w.dump(data, f)
    os.replace(tmp, path)


def load_settings(path: Path) -> Settings:
    data = read_toml(path)
    known = {f.name: f for f in fields(Settings)}
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            continue  # other sections (models, ...) belong to other readers
        default = getattr(Settings(), key)
        if isinstance(default, bool) != isinstance(value, bool) or not isinstance(
            value, type(default)
        ):
            raise NpuchatError(f"{path}: {key} should be a {type(default).__name__}, got {value!r}")
        values[key] = value
    settings = Settings(**values)
    settings.validate(str(path))
    return settings


def save_settings(path: Path, settings: Settings) -> None:
    """Write settings back, keeping every table this module does not own."""
    data = read_toml(path)
    data.update(asdict(settings))
    write_toml(path, data)
