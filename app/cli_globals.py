"""The options given before the command (`npuchat --model phi3-int4 serve`).

They are the chat app's options, but a user who puts them before `run`, `bench`, `serve` or
`doctor` means them for that command: they reach it as if given after it, so the command never
runs the settings' model while the user named another. Before a command that has no use for
one, or given on both sides with different values, they are a one-line error, never silently
dropped.
"""

from __future__ import annotations

import argparse

from npuchat.engine.errors import NpuchatError

# the parser's dest of each option that may come before the command, and its flag
GLOBAL_FLAGS = {
    "model": "--model",
    "draft": "--draft",
    "device": "--device",
    "kv_dtype": "--kv-dtype",
    "context": "--context",
    "server": "--server",
    "server_api_key": "--api-key",
    "server_api_key_file": "--api-key-file",
}

# command: {dest before the command: the command's own dest for the same option}
COMMAND_DESTS: dict[str, dict[str, str]] = {
    "run": {
        "model": "run_model",
        "draft": "run_draft",
        "device": "run_device",
        "kv_dtype": "run_kv_dtype",
        "context": "run_context",
    },
    "bench": {
        "model": "bench_model",
        "draft": "bench_draft",
        "device": "bench_device",
        "kv_dtype": "bench_kv_dtype",
    },
    "serve": {
        "model": "serve_model",
        "draft": "serve_draft",
        "device": "serve_device",
        "kv_dtype": "serve_kv_dtype",
        "context": "serve_context",
    },
    # doctor's --device names the device to report on (default npu), not where a model runs
    "doctor": {"model": "doctor_model"},
}

# a flag a command has too, after it, with another meaning: what to say instead
OTHER_MEANING = {
    ("doctor", "device"): "put it after `doctor`, where it names the device to report on",
    ("serve", "server_api_key"): (
        "that one is the key for `--server`; `npuchat serve --api-key KEY` sets the key "
        "clients must send"
    ),
    ("serve", "server_api_key_file"): (
        "that one is the key for `--server`; `npuchat serve --api-key-file FILE` sets the keys "
        "clients must send"
    ),
}


def apply_global_options(args: argparse.Namespace) -> None:
    """Move the options given before `args.command` onto the command's own (in place)."""
    command = args.command
    if command is None:  # the chat app: they are its own
        return
    own = COMMAND_DESTS.get(command, {})
    for dest, flag in GLOBAL_FLAGS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if dest not in own:
            hint = OTHER_MEANING.get(
                (command, dest), f"see `npuchat {command} --help` for its options"
            )
            raise NpuchatError(f"{flag} before `{command}` is not used by it; {hint}")
        mine = getattr(args, own[dest])
        if mine is None:
            setattr(args, own[dest], value)
        elif mine != value:
            raise NpuchatError(
                f"{flag} is given twice ({value} before `{command}`, {mine} after it); give it once"
            )
