"""`npuchat` with no subcommand: open the chat app.

The model is pulled (first run) and loaded by the app's loader in a worker thread, behind a
progress screen, so the terminal shows the app at once and nothing blocks before it.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from rich.console import Console

from npuchat.engine.devices import pick_device
from npuchat.engine.errors import NpuchatError

from .context import AppContext
from .engine_factory import check_draft, make_loader
from .engine_port import catalog_lister


def launch_app(args: argparse.Namespace, console: Console) -> int:
    from .store import ConversationStore
    from .tui.app import run_app

    ctx = AppContext.load()
    # read by the loader, which builds the engine from `ctx`
    ctx = ctx.with_settings(kv_dtype=args.kv_dtype, context=args.context)
    settings = replace(
        ctx.settings,
        model=args.model or ctx.settings.model,
        draft=args.draft if args.draft is not None else ctx.settings.draft,
        device=args.device or ctx.settings.device,
    )
    if args.server:  # a served engine: nothing to pull or load here
        from .api_keys import api_keys
        from .openai_engine import base_url, remote_loader

        base_url(args.server)  # a malformed URL fails here, before the screen opens
        keys = api_keys(args.server_api_key, args.server_api_key_file)
        loader = remote_loader(args.server, keys[0] if keys else None, args.model)
        models = None  # the server knows its models; the picker offers the local catalog
    else:
        if args.server_api_key is not None or args.server_api_key_file is not None:
            raise NpuchatError(
                "--api-key and --api-key-file are the key for --server URL; give the server too"
            )
        ctx.catalog.get(settings.model)  # unknown names fail here, before the screen opens
        check_draft(settings.draft)
        pick_device(settings.device)
        loader = make_loader(ctx)
        models = catalog_lister(ctx.catalog)
    store = ConversationStore.open(ctx.paths.database_file)
    try:
        return run_app(
            settings,
            store,
            loader,
            config_path=ctx.paths.config_file,
            models=models,
        )
    finally:
        store.close()
