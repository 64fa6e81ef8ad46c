"""`npuchat` with no subcommand: make sure the chosen model is installed, then open the chat.

On first run the default model (and its draft) is pulled here, with a progress bar in the
terminal, before anything else happens.
"""

from __future__ import annotations

import argparse

from rich.console import Console

from .context import AppContext
from .model_commands import pull_model


def launch_app(args: argparse.Namespace, console: Console) -> int:
    ctx = AppContext.load()
    model = args.model or ctx.settings.model
    draft = args.draft if args.draft is not None else ctx.settings.draft
    entry = ctx.catalog.get(model)
    with_draft = draft in ("", entry.default_draft)
    pull_model(ctx, model, console=console, with_draft=with_draft)
    if draft and draft not in ("none", "lookup"):
        pull_model(ctx, draft, console=console, with_draft=False)
    console.print(
        f"{model} is installed and verified. The chat UI arrives with the TUI issue; "
        "until then use `npuchat tokenize`.",
        highlight=False,
    )
    return 0
