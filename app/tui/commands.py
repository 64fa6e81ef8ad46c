"""Command palette entries for every main action of the chat screen."""

from __future__ import annotations

from functools import partial

from textual.command import DiscoveryHit, Hit, Hits, Provider

# (title, help, action on the chat screen)
CHAT_COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("New chat", "Start a new conversation", "new_chat"),
    ("Rename chat", "Change the current conversation's title", "rename_chat"),
    ("Delete chat", "Delete the current conversation (asks first)", "delete_chat"),
    ("Search chats", "Search conversations by title and content", "search"),
    ("Regenerate reply", "Generate the last reply again", "regenerate"),
    ("Stop generating", "Stop the reply being generated", "stop"),
    ("Continue reply", "Extend the last reply that stopped at the token limit", "continue_reply"),
    ("Edit last message", "Edit your last message and continue from there", "edit_last"),
    ("Copy code block", "Copy the last code block of the latest reply", "copy_code"),
    ("Conversation settings", "System prompt, model, draft, sampling", "settings"),
    ("Export as Markdown", "Save this conversation to a .md file", "export('markdown')"),
    ("Export as JSON", "Save this conversation to a .json file", "export('json')"),
    ("Toggle metrics panel", "Show or hide the live engine panel", "toggle_metrics"),
    ("Toggle sidebar", "Show or hide the conversation list", "toggle_sidebar"),
    ("Help: keys", "List every key binding", "app.help"),
)


class ChatCommands(Provider):
    """Runs the actions on the screen the palette was opened from (the chat screen)."""

    async def _run(self, action: str) -> None:
        await self.screen.run_action(action)

    async def discover(self) -> Hits:
        for title, help_text, action in CHAT_COMMANDS:
            yield DiscoveryHit(title, partial(self._run, action), help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for title, help_text, action in CHAT_COMMANDS:
            score = matcher.match(title)
            if score > 0:
                command = partial(self._run, action)
                yield Hit(score, matcher.highlight(title), command, help=help_text)
