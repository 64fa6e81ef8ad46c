"""Typed user settings from `config.toml`.

The file is read with tomllib and edited with tomlkit: a change rewrites only the key that
changed and keeps the user's comments, order and formatting. Only known keys are interpreted;
the `[models.*]` tables belong to the model catalog (`npuchat.engine.catalog`). A file that
cannot be parsed is an error naming the file and line, never silently replaced.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import tomlkit
import tomlkit.exceptions

from npuchat.engine.devices import DEVICE_CHOICES
from npuchat.engine.errors import NpuchatError
from npuchat.engine.kv_layout import DEFAULT_CONTEXT, KV_AUTO, KV_CHOICES, MAX_CONTEXT, MIN_CONTEXT

DEFAULT_MODEL = "qwen2.5-coder-1.5b"


@dataclass
class Settings:
    """What the user can set.

    `draft`: "lookup" (the default: prompt-lookup drafts cost nothing and speculation is exact,
    so it can only help), "default" (the catalog's draft model plus lookup), a model name, or
    empty / "none" for plain decoding. `kv_dtype`: how the KV cache stores K/V on the CPU:
    "auto" (f16 where the native kernels run, else f32), "f32", "f16" (half the memory) or
    "int8" (about a quarter; `engine/kv_layout.py`). `context`: the most tokens a conversation
    may hold, 0 for the model's trained context up to 8,192 (the KV cache grows to it as a
    conversation fills, a few hundred MiB a slot at 32k on the 0.5B model).
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
    kv_dtype: str = KV_AUTO
    context: int = 0

    def validate(self, source: str) -> None:
        for name in ("device", "draft_device"):
            value = getattr(self, name)
            if value and value not in DEVICE_CHOICES:
                raise NpuchatError(
                    f"{source}: {name} = {value!r} is not one of {', '.join(DEVICE_CHOICES)}"
                )
        if self.kv_dtype not in KV_CHOICES:
            raise NpuchatError(
                f"{source}: kv_dtype = {self.kv_dtype!r} is not one of {', '.join(KV_CHOICES)}"
            )
        if self.context != 0 and not MIN_CONTEXT <= self.context <= MAX_CONTEXT:
            raise NpuchatError(
                f"{source}: context must be 0 (the model's, up to {DEFAULT_CONTEXT}) or "
                f"{MIN_CONTEXT} to {MAX_CONTEXT} tokens"
            )
        if not 0 <= self.threads <= 1024:
            raise NpuchatError(f"{source}: threads must be 0 (auto) or a number up to 1024")


def read_toml(path: Path) -> dict[str, Any]:
    """Parse a TOML file; a missing file is an empty table, a broken one a one-line error."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        return {}
    except tomllib.TOMLDecodeError as exc:
        raise NpuchatError(f"{path} is not valid TOML ({exc}); fix or remove that line") from exc
    except UnicodeDecodeError as exc:
        raise NpuchatError(
            f"{path} is not UTF-8 text (byte {exc.start}); save it as UTF-8 or remove it"
        ) from exc
    except OSError as exc:
        raise NpuchatError(f"cannot read {path}: {exc.strerror}") from exc


def edit_toml(path: Path, edit: Callable[[tomlkit.TOMLDocument], None]) -> None:
    """Apply `edit` to the file's TOML document and write it back atomically (temp file +
    rename, so a crash never leaves half a config); comments and untouched keys stay as the
    user wrote them. A missing file starts empty."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        text = ""
    try:
        doc = tomlkit.parse(text)
    except tomlkit.exceptions.ParseError as exc:
        raise NpuchatError(f"{path} is not valid TOML ({exc}); fix or remove that line") from exc
    edit(doc)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(tomlkit.dumps(doc), encoding="utf-8")
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


def set_setting(path: Path, name: str, value: object) -> None:
    """Change one setting in `path`, leaving the rest of the file as it is.

    The file is checked first (a broken or invalid one is refused, not overwritten), and the
    value must fit the setting's type."""
    current = load_settings(path)
    if name not in {f.name for f in fields(Settings)}:
        raise NpuchatError(f"unknown setting {name!r}")
    default = getattr(Settings(), name)
    if isinstance(default, bool) != isinstance(value, bool) or not isinstance(value, type(default)):
        raise NpuchatError(f"{name} should be a {type(default).__name__}, got {value!r}")
    setattr(current, name, value)
    current.validate(str(path))

    def change(doc: tomlkit.TOMLDocument) -> None:
        doc[name] = value

    edit_toml(path, change)
