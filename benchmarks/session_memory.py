"""Memory over a long chat session: RSS after 10 and after 100 turns, a new conversation each.

    python benchmarks/session_memory.py [--model smollm2-135m] [--turns 100] [--gguf FILE]

Drives the real app (headless, through Textual's pilot) on a real model, the way a user does:
Ctrl+N, type a question, wait for the reply, again. Prints RSS at turns 1, 10, 25, 50 and 100,
the ratio of the last turn to turn 10 (the budget: at most 1.2x), the prefix store's bytes and
entries, the widgets on screen and the DOM nodes Python still holds (mounted or not). With
`--trace`, also the Python allocations that grew most from turn 10 to the last (tracemalloc; its
own bookkeeping then inflates RSS, so the RSS figures of a traced run are not the budget's). The
database and caches live in a private folder; graphs are built before the first turn is counted.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from textual.dom import DOMNode

from npuchat.app.engine_factory import make_loader
from npuchat.app.settings import Settings
from npuchat.app.store import ConversationStore
from npuchat.app.tui.app import NpuchatApp
from npuchat.app.tui.chat_screen import ChatScreen
from npuchat.app.tui.composer import Composer

CHECKPOINTS = (1, 10, 25, 50, 100, 200)
QUESTIONS = (
    "Write a Python function that reverses a string.",
    "What is the capital of France? Answer in one sentence.",
    "List three uses of a hash map.",
    "Explain recursion to a child in two sentences.",
)


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def drive(app: NpuchatApp, turns: int, trace: bool) -> list[tuple[int, float, str]]:
    rows: list[tuple[int, float, str]] = []
    t0 = time.monotonic()
    async with app.run_test(size=(120, 40)) as pilot:
        while not isinstance(app.screen, ChatScreen):
            await pilot.pause(0.2)
        screen = app.screen
        assert isinstance(screen, ChatScreen)
        engine = app.engine
        for turn in range(1, turns + 1):
            await pilot.press("ctrl+n")  # through the app's queue, as a user's key would go
            await pilot.pause(0.1)
            composer = screen.query_one(Composer)
            composer.focus()
            composer.text = f"{QUESTIONS[turn % len(QUESTIONS)]} (#{turn})"
            await pilot.press("enter")
            await pilot.pause(0.05)
            while screen.generating or screen.conversation is None:
                await pilot.pause(0.05)
            await pilot.pause(0.2)  # let the sidebar refresh that ends a reply finish
            if turn in CHECKPOINTS or turn == turns:
                gc.collect()
                rows.append((turn, rss_mib(), _detail(app, engine)))
                print(f"turn {turn}: {rows[-1][1]:.1f} MiB at {time.monotonic() - t0:.0f} s")
                if turn == 10 and trace:
                    tracemalloc.start(5)
                    snapshot_10 = tracemalloc.take_snapshot()
        if tracemalloc.is_tracing():
            grown = tracemalloc.take_snapshot().compare_to(snapshot_10, "lineno")[:8]
            print("Python allocations that grew most after turn 10:")
            for stat in grown:
                print(f"  {stat.size_diff / 1024:+9.1f} KiB  {stat.traceback}")
            tracemalloc.stop()
    return rows


def _detail(app: NpuchatApp, engine: object) -> str:
    prefixes = getattr(engine, "prefixes", None)
    store = "" if prefixes is None else f"prefix store {prefixes.nbytes / 2**20:.1f} MiB"
    store += f" in {len(prefixes)} entries" if prefixes is not None else ""
    widgets = sum(1 for _ in app.screen.walk_children())
    nodes = sum(1 for o in gc.get_objects() if isinstance(o, DOMNode))
    return f"{store}, {widgets} widgets on screen, {nodes} DOM nodes alive"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--gguf", type=Path, help="a GGUF to import as the model (else: pulled)")
    p.add_argument("--turns", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--trace", action="store_true", help="tracemalloc from turn 10 on")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="npuchat-mem-") as home:
        os.environ["NPUCHAT_HOME"] = home
        from npuchat.app.cli import main as cli
        from npuchat.app.context import AppContext

        if args.gguf is not None and cli(["import", str(args.gguf), "--name", args.model]) != 0:
            return 1
        ctx = AppContext.load()
        settings = Settings(model=args.model, draft="lookup", device="cpu", cursor_blink=False)
        store = ConversationStore.open(ctx.paths.database_file)
        from dataclasses import replace

        app = NpuchatApp(settings, store, make_loader(ctx))
        default = app.default_conversation_settings()
        app.default_conversation_settings = lambda: replace(  # type: ignore[method-assign]
            default, max_tokens=args.max_tokens, temperature=0.0
        )
        t0 = time.monotonic()
        rows = asyncio.run(drive(app, args.turns, args.trace))
        store.close()
    print(f"{args.turns} turns of {args.model} in {time.monotonic() - t0:.0f} s")
    print(f"{'turn':>5} {'RSS MiB':>9}  detail")
    for turn, rss, detail in rows:
        print(f"{turn:>5} {rss:>9.1f}  {detail}")
    by_turn = {t: r for t, r, _ in rows}
    if 10 in by_turn and args.turns in by_turn:
        ratio = by_turn[args.turns] / by_turn[10]
        print(f"RSS after {args.turns} turns / after 10: {ratio:.3f}x (budget 1.2x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
