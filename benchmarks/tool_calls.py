"""Tool calls on a real model through `npuchat serve`'s API: which asks come back as calls an
offered tool's schema allows, under `tool_choice` auto, required (held to the call grammar) and
required with the grammar turned off (the model writes the call itself).

    python benchmarks/tool_calls.py [--model qwen2.5-coder-0.5b] [--max-tokens 200]

Five everyday asks, three tools (an alarm with bounded hour and minute, a timer, the weather
with a unit enum), greedy. Per ask and mode it prints the finish reason and each call with
whether its tool was offered and its arguments fit the tool's schema (required keys, no others,
types, bounds, enums), else the start of the text; then a count per mode. A script that prints
figures, not a test: the model's choice of tool is its own, right or wrong.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai

from npuchat.app.serve import prepare
from npuchat.app.serve.server import ServedModel, Server, create_app
from npuchat.engine.concurrent_engine import ConcurrentEngine
from npuchat.engine.drafters import LookupDrafter
from npuchat.engine.session import ChatSession

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from serve_load import model_path  # (a sibling script)
from tool_asks import ASKS, SCHEMAS, TOOLS, fits  # (what the real-model test asks too)


@contextmanager
def grammar_off() -> Iterator[None]:
    """Forced calls without their grammar: the opening and name written in, the rest free."""
    held = prepare.call_grammar
    prepare.call_grammar = lambda *args, **kw: None  # type: ignore[assignment]
    try:
        yield
    finally:
        prepare.call_grammar = held


def ask_all(client: openai.OpenAI, model: str, choice: str, max_tokens: int) -> int:
    """Prints each ask's outcome; the number of replies that were only good calls."""
    good = 0
    for ask in ASKS:
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": ask}],
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice=choice,  # type: ignore[arg-type]
            temperature=0,
            max_tokens=max_tokens,
        )
        c = r.choices[0]
        calls = c.message.tool_calls or []
        shown, oks = [], []
        for call in calls:
            name, text = call.function.name, call.function.arguments  # type: ignore[union-attr]
            try:
                ok = name in SCHEMAS and fits(json.loads(text), SCHEMAS[name])
            except ValueError:
                ok = False
            oks.append(ok)
            shown.append(f"{name}({text}){'' if ok else ' (does not fit)'}")
        good += bool(calls) and all(oks)
        what = "; ".join(shown) if calls else repr((c.message.content or "")[:70])
        print(f"  {ask[:34]:34} {c.finish_reason:10} {what}", flush=True)
    return good


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--gguf", type=Path, help="GGUF file (default: the catalog's)")
    ap.add_argument("--max-tokens", type=int, default=200)
    args = ap.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="npuchat-tool-calls-"))
    session = ChatSession.open(
        model_path(args.model, args.gguf), name=args.model, cache_dir=cache, capacities=[1024]
    )
    session.use_drafters([LookupDrafter()])
    engine = ConcurrentEngine(session)
    card = ServedModel(args.model, session.model.max_capacity, session.draft_name, session.device)
    totals = {}
    try:
        with Server(create_app(engine, card, slots=None), "127.0.0.1", 0) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="local", max_retries=0)
            for mode in ("auto", "required", "required, no grammar"):
                print(f"{args.model}, tool_choice {mode}:", flush=True)
                choice = mode.split(",")[0]
                if mode.endswith("no grammar"):
                    with grammar_off():
                        totals[mode] = ask_all(client, args.model, choice, args.max_tokens)
                else:
                    totals[mode] = ask_all(client, args.model, choice, args.max_tokens)
    finally:
        engine.close()
    for mode, good in totals.items():
        print(f"{mode:22} {good}/{len(ASKS)} replies: only calls an offered tool's schema allows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
