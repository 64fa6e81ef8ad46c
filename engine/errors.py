"""User-facing errors.

Every error a user can cause (a bad name, a missing file, a corrupt download) is raised as an
`NpuchatError` whose message is one line that says what to do. The CLI prints it and exits 2;
the TUI shows it as a notification. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class NpuchatError(Exception):
    """An error with a one-line, actionable message for the user."""


class ModelNotFoundError(NpuchatError):
    """A model name that is neither in the catalog nor imported."""


class ModelNotInstalledError(NpuchatError):
    """A catalog model that has not been pulled yet."""


class IntegrityError(NpuchatError):
    """A file whose hash or schema does not match what was recorded: never used, never deleted."""


class UnsupportedModelError(NpuchatError):
    """A GGUF whose architecture or tensor layout the engine cannot build graphs for."""


class InvalidRequestError(NpuchatError):
    """A request the engine cannot serve as asked (a prompt longer than the context): the
    caller's to fix, reported as `Failed(kind="invalid")`."""


class PromptTooLongError(InvalidRequestError):
    """A prompt that leaves the context no room for a reply. It carries the two counts, so a
    server can say it in its API's own words (OpenAI's `context_length_exceeded`, Anthropic's
    "prompt is too long"), on which clients act (trim the history, compact it)."""

    def __init__(self, message: str, prompt_tokens: int, context: int) -> None:
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.context = context


class RequestCancelled(NpuchatError):
    """A request's cancel event was set while it waited for, or ran, a model step."""
