"""`npuchat serve`: load a model and serve the OpenAI and Anthropic APIs on it until
interrupted."""

from __future__ import annotations

import argparse
import errno
import socket
import sys
import threading

from rich.console import Console

from npuchat.engine.devices import pick_device
from npuchat.engine.errors import NpuchatError
from npuchat.engine.grammar import prepare_vocabulary

from ..api_keys import api_keys
from ..context import AppContext
from ..engine_factory import check_draft, open_concurrent_engine
from ..engine_port import EngineSpec
from ..progress import RichPullProgress
from .auth import check_bind, is_loopback
from .server import ServedModel, Server, create_app


def _check_port(host: str, port: int) -> None:
    """Fail with one line before the model loads, not after, when the port cannot be had."""
    if not 0 <= port <= 65535:
        raise NpuchatError(f"--port {port}: give a port from 0 to 65535")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            why = "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc})"
            raise NpuchatError(f"{host}:{port} {why}; pick another --port or --host") from None


def cmd_serve(ctx: AppContext, args: argparse.Namespace) -> int:
    if args.max_queue < 0:
        raise NpuchatError("--max-queue: give 0 or more")
    keys = api_keys(args.api_key, args.api_key_file)
    check_bind(args.host, keys)
    _check_port(args.host, args.port)
    model = args.serve_model or ctx.settings.model
    draft = ctx.settings.draft if args.serve_draft is None else args.serve_draft
    device = args.serve_device or ctx.settings.device
    ctx.catalog.get(model)
    check_draft(draft)
    ctx = ctx.with_settings(kv_dtype=args.serve_kv_dtype, context=args.serve_context)
    pick_device(device)
    err = Console(stderr=True)
    engine = open_concurrent_engine(
        ctx,
        EngineSpec(model, draft, device),
        pull_progress=RichPullProgress(err),
        max_queue=args.max_queue,
    )
    try:
        card = ServedModel(model, engine.model.max_capacity, engine.draft_name, engine.device)
        # the engine runs batch_max replies at once and queues the rest itself
        app = create_app(
            engine,
            card,
            api_keys=keys,
            slots=None,
            allowed_origins=tuple(args.allow_origin),
            loopback=is_loopback(args.host),
        )
        server = Server(app, args.host, args.port, log_level="info")
        # JSON mode, schemas and forced tool calls need it: ~1 s of the first one's otherwise
        vocab = threading.Thread(target=prepare_vocabulary, args=(engine.tokenizer,), daemon=True)
        vocab.start()
        print(
            f"npuchat: serving {model} ({card.context_length} tokens of context, "
            f"draft {card.draft or 'none'}, {card.device}, {engine.batch_max} replies at once) "
            f"at {server.url_for(args.port)}/v1"
            f"{'' if keys else ' (no API key: any user of this machine may use it)'}; "
            "Ctrl+C stops",
            file=sys.stderr,
        )
        server.run()
    finally:
        engine.close()
    return 0
