"""Built-in Textual themes, stored as TOML data files, and the loader for user themes.

A theme file holds the fields of `textual.theme.Theme` (`name`, `primary`, `dark`, ...) and a
`[variables]` table. npuchat's own widgets read their colours from `npuchat-*` variables, so a
theme can restyle the metrics panel without touching any CSS; `THEME_VARIABLE_DEFAULTS` fills
those in for Textual's built-in themes.
"""

from __future__ import annotations

import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

from textual.color import Color, ColorParseError
from textual.theme import Theme

from npuchat.engine.errors import NpuchatError

BUILTIN_DIR = Path(__file__).resolve().parent

THEME_VARIABLE_DEFAULTS: dict[str, str] = {
    "npuchat-metric-label": "$text-muted",
    "npuchat-metric-value": "$text",
    "npuchat-metric-good": "$success",
    "npuchat-metric-warn": "$warning",
    "npuchat-sparkline-min": "$primary",
    "npuchat-sparkline-max": "$accent",
    "npuchat-kv-bar": "$primary",
    "npuchat-kv-bar-full": "$warning",
    "npuchat-user-border": "$primary",
    "npuchat-assistant-border": "$secondary",
}
"""Variables npuchat's CSS uses; a theme's [variables] table overrides any of them."""

_COLOR_FIELDS = (
    "primary",
    "secondary",
    "warning",
    "error",
    "success",
    "accent",
    "foreground",
    "background",
    "surface",
    "panel",
    "boost",
)
_ALLOWED = {f.name for f in fields(Theme)}


def load_theme_file(path: Path) -> Theme:
    """Read one TOML theme file. Anything wrong is a one-line NpuchatError naming the file."""
    try:
        with open(path, "rb") as f:
            data: dict[str, Any] = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise NpuchatError(f"theme {path} is not valid TOML ({exc})") from exc
    except UnicodeDecodeError as exc:
        raise NpuchatError(f"theme {path} is not UTF-8 text (byte {exc.start})") from exc
    except OSError as exc:
        raise NpuchatError(f"cannot read theme {path}: {exc.strerror}") from exc
    unknown = sorted(set(data) - _ALLOWED)
    if unknown:
        raise NpuchatError(f"theme {path}: unknown keys {', '.join(unknown)}")
    if not isinstance(data.get("name"), str) or not data["name"]:
        raise NpuchatError(f'theme {path}: needs a name = "..."')
    if not isinstance(data.get("primary"), str):
        raise NpuchatError(f'theme {path}: needs a primary = "#rrggbb" colour')
    for key in _COLOR_FIELDS:
        if key in data:
            _check_color(path, key, data[key])
    variables = data.get("variables", {})
    if not isinstance(variables, dict) or not all(isinstance(v, str) for v in variables.values()):
        raise NpuchatError(f"theme {path}: [variables] must map names to colour strings")
    for key in ("dark", "ansi"):
        if key in data and not isinstance(data[key], bool):
            raise NpuchatError(f"theme {path}: {key} must be true or false")
    for key in ("luminosity_spread", "text_alpha"):
        value = data.get(key, 0.5)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
            raise NpuchatError(f"theme {path}: {key} must be a number from 0 to 1, got {value!r}")
    return Theme(**data)


def _check_color(path: Path, key: str, value: object) -> None:
    if not isinstance(value, str):
        raise NpuchatError(f'theme {path}: {key} must be a colour string like "#1e88e5"')
    try:
        Color.parse(value)
    except ColorParseError as exc:
        raise NpuchatError(f"theme {path}: {key} = {value!r} is not a colour") from exc


def builtin_themes() -> list[Theme]:
    """The themes shipped in this package (errors here are bugs, so they propagate)."""
    return [load_theme_file(p) for p in sorted(BUILTIN_DIR.glob("*.toml"))]


def user_themes(theme_dir: Path) -> tuple[list[Theme], list[str]]:
    """Themes from the user's config dir, plus one message per file that could not be loaded:
    a broken user theme must not stop the app from starting."""
    themes: list[Theme] = []
    problems: list[str] = []
    if not theme_dir.is_dir():
        return themes, problems
    for path in sorted(theme_dir.glob("*.toml")):
        try:
            themes.append(load_theme_file(path))
        except NpuchatError as exc:
            problems.append(str(exc))
    return themes, problems


def resolve_references(variables: dict[str, str]) -> dict[str, str]:
    """Replace values that name another variable (`"$primary"`) by that variable's value, so
    the defaults above follow whichever theme is active."""
    resolved = dict(variables)
    for _ in range(4):  # references may chain a few levels; cycles just stay unresolved
        changed = False
        for key, value in resolved.items():
            ref = value[1:] if value.startswith("$") else None
            if ref and ref in resolved and not resolved[ref].startswith("$"):
                resolved[key] = resolved[ref]
                changed = True
        if not changed:
            break
    return resolved
