"""Checking `[keymap]` from config.toml before Textual sees it.

Why: Textual takes any string as a key and any value as a binding, so `send = 5` crashed the app
and `send = "not-a-key"` silently left Enter doing nothing. Every entry is checked here: its id
must exist, its value must be a string of key names Textual can deliver, and it must not take a
key another binding in the same place already uses. A bad entry is dropped (its default key is
kept) with one warning line the app shows at start.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping

from textual.keys import KEY_NAME_REPLACEMENTS, Keys

from npuchat.app.tui.keys import DIALOG_IDS, KEYS

MODIFIERS = frozenset({"ctrl", "shift", "alt", "meta", "super", "hyper"})
_NAMED = frozenset(k.value for k in Keys) | frozenset(KEY_NAME_REPLACEMENTS.values())
_NAMED |= {"enter", "space", "tab", "backspace", "delete", "insert"}
_ALIASES = {v: k for k, v in KEY_NAME_REPLACEMENTS.items()}

# Places whose bindings are live at the same time (the composer sits in the chat screen).
_TOGETHER = {
    frozenset({"Input", "Chat"}),
    frozenset({"Message", "Chat"}),
    frozenset({"Sidebar", "Chat"}),
}


def is_key_name(name: str) -> bool:
    """A single key as Textual names it: `a`, `enter`, `f5`, `ctrl+shift+up`, `question_mark`."""
    *mods, key = name.split("+")
    if not key or any(m not in MODIFIERS for m in mods) or len(set(mods)) != len(mods):
        return False
    if len(key) == 1 and key.isprintable() and not key.isspace():
        return True
    if key in _NAMED or key in MODIFIERS:
        return key not in MODIFIERS
    try:
        unicodedata.lookup(_ALIASES.get(key, key).replace("_", " ").upper())
    except KeyError:
        return False
    return True


def _keys(value: str) -> list[str]:
    return [k.strip() for k in value.split(",")]


def _overlap(a: str, b: str) -> bool:
    return a == b or "App" in (a, b) or frozenset({a, b}) in _TOGETHER


def check_keymap(keymap: Mapping[str, object]) -> tuple[dict[str, str], list[str]]:
    """The usable part of `keymap`, and one warning per entry dropped."""
    warnings: list[str] = []
    usable: dict[str, str] = {}
    for binding_id, value in keymap.items():
        if binding_id not in KEYS and binding_id not in DIALOG_IDS:
            warnings.append(f"[keymap] {binding_id!r}: no such binding (F1 lists the ids)")
        elif not isinstance(value, str) or not value.strip():
            warnings.append(
                f'[keymap] {binding_id} = {value!r}: give keys as a string, like "ctrl+g";'
                " the default is kept"
            )
        elif bad := [k for k in _keys(value) if not is_key_name(k)]:
            warnings.append(
                f"[keymap] {binding_id} = {value!r}: {', '.join(map(repr, bad))} is not a key"
                " name (like enter, f5, ctrl+g); the default is kept"
            )
        else:
            usable[binding_id] = ",".join(_keys(value))
    for binding_id in [i for i in usable if i in KEYS]:
        spec = KEYS[binding_id]
        mine = set(_keys(usable[binding_id]))
        for other in KEYS.values():
            if other.id == binding_id or not _overlap(spec.where, other.where):
                continue
            taken = mine & set(_keys(usable.get(other.id, other.key)))
            if taken:
                warnings.append(
                    f"[keymap] {binding_id} = {usable[binding_id]!r}: {', '.join(sorted(taken))}"
                    f" is already {other.id}'s key; the default ({spec.key}) is kept"
                )
                del usable[binding_id]
                break
    return usable, warnings
