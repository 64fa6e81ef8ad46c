"""What the user does to a whole conversation through a dialog: rename, delete, export, settings.

Kept apart from the chat screen, which owns layout and replies: each action opens its dialog and,
when the user confirms, changes the store and asks the screen to show the result.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from npuchat.app.store import ConversationStore
from npuchat.app.store_records import Conversation, ConversationSettings
from npuchat.app.tui.dialogs import ConfirmScreen, PromptScreen
from npuchat.app.tui.settings_modal import SettingsScreen
from npuchat.engine.errors import NpuchatError

if TYPE_CHECKING:
    from npuchat.app.tui.chat_screen import ChatScreen


class ConversationActions:
    def __init__(self, screen: ChatScreen) -> None:
        self.screen = screen

    @property
    def _store(self) -> ConversationStore:
        return self.screen.npuchat.store

    def rename(self) -> None:
        screen = self.screen
        conv = screen.conversation
        if conv is None:
            screen.notify("Send a message first; a new chat has nothing to rename.")
            return

        async def done(title: str | None) -> None:
            if title:
                self._store.rename(conv.id, title)
                await screen.conversation_changed(conv.id)

        screen.app.push_screen(PromptScreen("Rename chat", conv.title), done)

    def delete(self, conv: Conversation | None = None) -> None:
        screen = self.screen
        conv = conv or screen.conversation
        if conv is None:
            screen.notify("This chat is not saved yet; nothing to delete.")
            return
        if screen.replies.get(conv.id) is not None:
            screen.notify("Stop the reply (Esc) before deleting this chat.")
            return

        async def done(confirmed: bool | None) -> None:
            if not confirmed:
                return
            self._store.delete_conversation(conv.id)
            current = screen.conversation
            if current is not None and current.id == conv.id:
                await screen.action_new_chat()
            else:
                await screen.refresh_sidebar()
            screen.notify(f"Deleted “{conv.title or 'New chat'}”", timeout=3)

        question = f"Delete “{conv.title or 'New chat'}” and all its messages?"
        screen.app.push_screen(ConfirmScreen(question), done)

    def settings(self) -> None:
        screen = self.screen
        conv = screen.conversation
        title = conv.title if conv and conv.title else "new chat"

        async def done(settings: ConversationSettings | None) -> None:
            if settings is None:
                return
            await self._apply(settings)
            screen.notify("Settings saved; they apply from the next reply.", timeout=3)

        app_settings = screen.npuchat.settings
        defaults = {
            "model": f"empty: {app_settings.model}",
            "draft": f"empty: {app_settings.draft or 'none'} · none · lookup · default · a name",
        }
        models = screen.npuchat.models()
        names = [m.name for m in models] if models is not None else None
        screen.app.push_screen(
            SettingsScreen(screen.current_settings, title, defaults, names), done
        )

    async def use_model(self, name: str) -> None:
        """The conversation on screen (or the new chat) uses `name` from its next reply."""
        screen = self.screen
        await self._apply(replace(screen.current_settings, model=name))
        known = {m.name: m for m in screen.npuchat.models() or []}
        pulled = "" if name not in known or known[name].installed else " (pulled first)"
        screen.notify(f"This chat uses {name} from the next reply{pulled}.", timeout=4)

    async def _apply(self, settings: ConversationSettings) -> None:
        """Store `settings` for the conversation on screen, or keep them for the new chat."""
        screen = self.screen
        current = screen.conversation
        if current is not None:
            self._store.update_settings(current.id, settings)
            await screen.conversation_changed(current.id)
        else:
            screen.new_chat_settings = settings

    def export(self, fmt: str = "markdown") -> None:
        screen = self.screen
        conv = screen.conversation
        if conv is None:
            screen.notify("Nothing to export yet.")
            return
        suffix = ".json" if fmt == "json" else ".md"
        default = Path.cwd() / (slug(conv.title or "chat") + suffix)

        def done(path_text: str | None) -> None:
            if not path_text:
                return
            try:
                path = self._store.export(conv.id, Path(path_text))
            except NpuchatError as exc:
                screen.notify(str(exc), title="Export failed", severity="error")
                return
            screen.notify(f"Exported to {path}", title="Export", timeout=6)

        hint = "A .json path writes JSON; any other path writes Markdown."
        screen.app.push_screen(PromptScreen("Export conversation to", str(default), hint), done)


def slug(title: str) -> str:
    """A file name from a title: letters and digits, dashes between."""
    text = re.sub(r"[^A-Za-z0-9]+", "-", title).strip("-").lower()
    return text[:48] or "chat"
