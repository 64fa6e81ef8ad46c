"""Every key binding of the app, in one table.

Each binding has an id, so `[keymap]` in config.toml can remap it (Textual's `App.set_keymap`),
and the help screen can list every key with the user's remapping applied. Widgets build their
`BINDINGS` from this table instead of spelling keys out, so the table is the single truth.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from textual.binding import Binding, BindingType


@dataclass(frozen=True)
class KeySpec:
    id: str
    key: str
    action: str
    description: str
    where: str
    show: bool = True
    priority: bool = False


_SPECS: tuple[KeySpec, ...] = (
    KeySpec("send", "enter", "submit", "Send", "Input", priority=True),
    KeySpec("newline", "shift+enter,ctrl+j", "newline", "New line", "Input", show=False),
    KeySpec("stop", "escape", "stop", "Stop", "Chat"),
    KeySpec("regenerate", "ctrl+r", "regenerate", "Regenerate", "Chat"),
    KeySpec("continue_reply", "ctrl+t", "continue_reply", "Continue", "Chat"),
    KeySpec("edit_last", "ctrl+l", "edit_last", "Edit last", "Chat", show=False),
    KeySpec("copy_code", "f5", "copy_code", "Copy code", "Chat", show=False),
    KeySpec("new_chat", "ctrl+n", "new_chat", "New", "Chat"),
    KeySpec("rename_chat", "f2", "rename_chat", "Rename", "Chat", show=False),
    KeySpec("delete_chat", "f8", "delete_chat", "Delete chat", "Chat", show=False),
    KeySpec("search", "ctrl+f", "search", "Search", "Chat", show=False),
    KeySpec("toggle_sidebar", "ctrl+b", "toggle_sidebar", "Chats", "Chat"),
    KeySpec("toggle_metrics", "f3", "toggle_metrics", "Metrics", "Chat"),
    KeySpec("settings", "ctrl+s", "settings", "Settings", "Chat"),
    KeySpec("export", "ctrl+o", "export", "Export", "Chat", show=False),
    KeySpec("message_edit", "e", "edit", "Edit and continue", "Message"),
    KeySpec("message_copy_code", "c", "copy_code", "Copy code block", "Message"),
    KeySpec("message_copy", "y", "copy_text", "Copy message", "Message"),
    KeySpec("list_delete", "delete", "delete", "Delete chat", "Sidebar"),
    KeySpec("help", "f1", "help", "Help", "App"),
    KeySpec(
        "command_palette", "ctrl+p", "command_palette", "Commands", "App", show=False, priority=True
    ),
    KeySpec("quit", "ctrl+q", "quit", "Quit", "App", priority=True),
)

KEYS: dict[str, KeySpec] = {spec.id: spec for spec in _SPECS}
# Ids of the dialogs' own bindings (defined next to them); remappable, not in the help table.
DIALOG_IDS = frozenset(
    {
        "dialog_cancel",
        "dialog_yes",
        "dialog_no",
        "help_close",
        "settings_cancel",
        "settings_save",
        "loading_quit",
    }
)


def bindings(*ids: str) -> list[BindingType]:
    """Textual bindings for the given ids, with their ids set (the keymap needs them)."""
    result: list[BindingType] = []
    for binding_id in ids:
        spec = KEYS[binding_id]
        result.append(
            Binding(
                spec.key,
                spec.action,
                spec.description,
                show=spec.show,
                priority=spec.priority,
                id=spec.id,
            )
        )
    return result


def unknown_keymap_ids(keymap: Mapping[str, str]) -> list[str]:
    return sorted(k for k in keymap if k not in KEYS and k not in DIALOG_IDS)


def effective_keys(keymap: Mapping[str, str]) -> list[tuple[str, str, str, str]]:
    """(where, keys, description, id) for the help screen, with the user's keymap applied."""
    return [
        (spec.where, keymap.get(spec.id, spec.key), spec.description, spec.id) for spec in _SPECS
    ]
