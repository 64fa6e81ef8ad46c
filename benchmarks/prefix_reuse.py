"""Prefix reuse benchmark (issue 5): TTFT with a ~1,000-token system prompt, measured side by side.

    python benchmarks/prefix_reuse.py [--model qwen2.5-coder-0.5b] [--idle 60]

Prints cold TTFT, a second conversation sharing the system prompt, the second turn of a
conversation (prefill tokens: only the new message), a new process that finds the prefix on
disk, and a conversation after the process sat idle (this machine pages out idle memory).
Ratios are to the cold figure of the same run. Uses a private cache folder, so the first
request is really cold (graphs are built before timing starts).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from npuchat.engine.catalog import Catalog
from npuchat.engine.events import ChatMessage, ChatRequest, Finished, SamplingParams
from npuchat.engine.paths import Paths
from npuchat.engine.pull import pull
from npuchat.engine.session import ChatSession

PARAGRAPH = (
    "You are a senior Python reviewer. Prefer small functions with clear names, type hints on "
    "every public function, docstrings that explain why rather than what, and tests that fail "
    "when behaviour breaks. Point out hidden state, needless copies and work done on hot paths. "
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def system_prompt(session: ChatSession, target: int) -> str:
    text = ""
    while len(session.tokenizer.encode(text)) < target:
        text += PARAGRAPH
    return text


def ask(session: ChatSession, system: str, turns: list[tuple[str, str]]) -> dict[str, float]:
    msgs = tuple(ChatMessage(r, c) for r, c in turns)  # type: ignore[arg-type]
    events = list(session.generate(ChatRequest("b", system, msgs, GREEDY), threading.Event()))
    final = events[-1]
    assert isinstance(final, Finished), final
    m = final.metrics
    reply = "".join(getattr(e, "text", "") for e in events)
    return {
        "ttft_s": m.ttft_s,
        "prefill": m.prefill_tokens,
        "reused": m.reused_tokens,
        "reply": reply,
    }  # type: ignore[dict-item]


def open_session(model: str, cache: Path) -> ChatSession:
    root = Path.home() / ".cache" / "npuchat-test"
    paths = Paths.from_env()
    catalog = Catalog.load(paths)
    try:
        path = catalog.resolve(model)
    except Exception:
        path, _ = pull(Catalog.load(Paths(root, root, root, root / "models")), model)
    return ChatSession.open(path, name=model, cache_dir=cache, capacities=[2048])


def child(model: str, cache: Path, system: str) -> None:
    s = open_session(model, cache)
    print(json.dumps(ask(s, system, [("user", "Review: def f(x): return x*2")])))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--idle", type=float, default=60.0)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--system", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.model, args.cache, args.system)
        return
    cache = Path(tempfile.mkdtemp(prefix="npuchat-bench-"))
    s = open_session(args.model, cache)
    system = system_prompt(s, args.system_tokens)
    rows = []
    cold = ask(s, system, [("user", "Review: def add(a, b): return a+b")])
    rows.append(("cold (first conversation)", cold))
    shared = ask(s, system, [("user", "Review: def sub(a, b): return a-b")])
    rows.append(("second conversation, same system prompt", shared))
    turn2 = ask(
        s,
        system,
        [
            ("user", "Review: def sub(a, b): return a-b"),
            ("assistant", str(shared["reply"])),
            ("user", "And with type hints?"),
        ],
    )
    rows.append(("second turn of that conversation", turn2))
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            "--model",
            args.model,
            "--cache",
            str(cache),
            "--system",
            system,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    rows.append(("new process (prefix from disk)", json.loads(out.stdout.strip().splitlines()[-1])))
    hot = ask(s, system, [("user", "Review: def mul(a, b): return a*b")])
    rows.append(("hot, just before idling", hot))
    time.sleep(args.idle)
    idle = ask(s, system, [("user", "Review: def div(a, b): return a/b")])
    rows.append((f"after {args.idle:.0f} s idle", idle))
    base = float(cold["ttft_s"])
    print(f"model {args.model}, system prompt {len(s.system_prefix(system))} tokens")
    print(f"{'case':42} {'TTFT s':>8} {'× cold':>7} {'prefill':>8} {'reused':>7}")
    for name, r in rows:
        t = float(r["ttft_s"])
        print(f"{name:42} {t:8.3f} {t / base:7.3f} {int(r['prefill']):8d} {int(r['reused']):7d}")
    print(f"idle / hot TTFT: {float(idle['ttft_s']) / float(hot['ttft_s']):.2f}")


if __name__ == "__main__":
    main()
