"""The `npuchat serve` options, kept apart from the server so that building the CLI parser
imports no HTTP stack."""

from __future__ import annotations

import argparse

from npuchat.engine.devices import DEVICE_CHOICES

from ..cli_args import add_context_argument, add_kv_dtype_argument

DEFAULT_MAX_QUEUE = 16


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", dest="serve_model", help="model to serve (default: from settings)")
    p.add_argument(
        "--draft", dest="serve_draft", help="speculative drafts: lookup, NAME, default, none"
    )
    p.add_argument("--device", dest="serve_device", choices=DEVICE_CHOICES)
    add_kv_dtype_argument(p, "serve_kv_dtype")
    add_context_argument(p, "serve_context")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (default: 8080)")
    key = p.add_mutually_exclusive_group()
    key.add_argument(
        "--api-key-file",
        metavar="FILE",
        help="require 'Authorization: Bearer KEY' with a key from FILE, one a line (needed "
        "beyond loopback; also: NPUCHAT_API_KEY)",
    )
    key.add_argument(
        "--api-key", help="as --api-key-file, but the key shows in `ps` to every user here"
    )
    p.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="let web pages from ORIGIN (https://host[:port], or * for any) use the server; "
        "pages from this machine may, others are refused (repeatable)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=DEFAULT_MAX_QUEUE,
        help=f"requests that may wait for the engine; more get 429 (default {DEFAULT_MAX_QUEUE})",
    )
