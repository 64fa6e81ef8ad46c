"""The arguments of the subcommands whose code loads the engine (`run`, `doctor`, `bench`).

They live apart from those commands so that building the parser imports no ONNX Runtime:
`npuchat --version`, `--help` and the catalog commands stay fast, and each command module is
imported only when it runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from npuchat.engine.bench_suites import SUITES
from npuchat.engine.devices import DEVICE_CHOICES, DEVICES
from npuchat.engine.kv_layout import DEFAULT_CONTEXT, KV_CHOICES, MAX_CONTEXT, MIN_CONTEXT


def add_kv_dtype_argument(p: argparse.ArgumentParser, dest: str) -> None:
    p.add_argument(
        "--kv-dtype",
        dest=dest,
        choices=list(KV_CHOICES),
        help="how the KV cache stores K/V on the CPU: auto (f16 where the native kernels run, "
        "else f32), f32, f16 (half) or int8 (about a quarter of the memory) (default: from "
        "settings, auto)",
    )


def context_tokens(text: str) -> int:
    """`--context N`: a whole number of tokens in the range a model can hold."""
    try:
        value = int(text.replace("_", "").replace(",", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of tokens") from None
    if not MIN_CONTEXT <= value <= MAX_CONTEXT:
        raise argparse.ArgumentTypeError(f"give {MIN_CONTEXT} to {MAX_CONTEXT} tokens")
    return value


def add_context_argument(p: argparse.ArgumentParser, dest: str) -> None:
    p.add_argument(
        "--context",
        dest=dest,
        type=context_tokens,
        metavar="N",
        help=f"the most tokens a conversation may hold, up to the model's trained context "
        f"(default: from settings, else the model's up to {DEFAULT_CONTEXT}); the KV cache "
        "grows to it as a conversation fills",
    )


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", dest="run_model", help="model name (default: from settings)")
    p.add_argument(
        "text",
        nargs="*",
        help="the prompt, its words joined by spaces (or --prompt; neither: standard input)",
    )
    p.add_argument("--prompt", "-p", help="the prompt (instead of the words after `run`)")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--system-file", type=Path, help="read the system prompt from a file")
    p.add_argument("--raw", action="store_true", help="no chat template; special tokens parsed")
    p.add_argument("--max-tokens", "-n", type=int, default=512)
    p.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="-2 to 2, taken off a token's logit if it is among the last 64 (OpenAI's)",
    )
    p.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="-2 to 2, taken off for every time the token is among the last 64",
    )
    p.add_argument(
        "--format",
        choices=["text", "json"],
        default="text",
        help="json: the reply is one JSON object, and ends when it closes (as ollama's)",
    )
    p.add_argument(
        "--logprobs",
        type=int,
        metavar="N",
        help="with --json: each token's log probability and the N likeliest tokens' (0-20)",
    )
    p.add_argument("--seed", type=int, help="random seed (-1 or absent: a random one)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="JSON lines: tokens, then metrics")
    p.add_argument(
        "--no-escape",
        action="store_true",
        help="print control characters in the reply as they are (by default they are shown"
        " escaped when standard output is a terminal, so a reply cannot control it)",
    )
    p.add_argument("--verbose", "-v", action="store_true", help="print metrics to stderr")
    p.add_argument("--conversation", help="continue a saved conversation (ID, or 'new')")
    p.add_argument(
        "--draft",
        dest="run_draft",
        help="speculative drafts: lookup, NAME, NAME+lookup, default (the catalog draft plus "
        "lookup) or none; every mode gives the same tokens (default: from settings, lookup)",
    )
    p.add_argument("--device", dest="run_device", choices=DEVICE_CHOICES)
    add_kv_dtype_argument(p, "run_kv_dtype")
    add_context_argument(p, "run_context")


def add_doctor_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", dest="doctor_model", help="also report this model's graph placement")
    p.add_argument("--device", dest="doctor_device", choices=DEVICES, default="npu", help="(npu)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", dest="bench_model", help="model name (default: from settings)")
    p.add_argument(
        "--draft",
        dest="bench_draft",
        help="drafts for the speculation figures: NAME, NAME+lookup, lookup or none "
        "(default: the model's catalog draft, plus lookup)",
    )
    p.add_argument("--device", dest="bench_device", choices=DEVICE_CHOICES)
    add_kv_dtype_argument(p, "bench_kv_dtype")
    p.add_argument("--suite", choices=sorted(SUITES), default="quick", help="default: quick")
    p.add_argument("--threads", dest="bench_threads", type=int, help="default: from settings")
    p.add_argument("--json", dest="bench_json", type=Path, metavar="FILE", help="write the report")
    p.add_argument(
        "--llama-bench",
        dest="llama_bench",
        metavar="PATH",
        help="llama.cpp's llama-bench binary: run it on the same GGUF and print ratios",
    )
