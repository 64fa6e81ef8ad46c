"""Prefix reuse benchmark: TTFT with a ~1,000-token system prompt, measured side by side.

    python benchmarks/prefix_reuse.py [--model qwen2.5-coder-0.5b] [--idle 60] [--kv-dtype int8]

Prints cold TTFT, a second conversation sharing the system prompt, the second turn of a
conversation (prefill tokens: only the new message), a new process that finds the prefix on
disk, and a conversation after the process sat idle (this machine pages out idle memory).
Ratios are to the cold figure of the same run. Uses a private cache folder, so the first
request is really cold (graphs are built before timing starts). The requests go through
`npuchat.engine.bench_timers.ask`, the same code as `npuchat bench`'s prefix-reuse figures;
this script adds the second turn and the idle case. `--kv-dtype` runs every case on that cache
dtype (the snapshots on disk keep it).
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

from npuchat.app.engine_factory import KEEP_WARM_S
from npuchat.engine.bench_timers import Reply, ask, system_prompt
from npuchat.engine.catalog import Catalog
from npuchat.engine.events import ChatMessage, ChatRequest, Finished, SamplingParams
from npuchat.engine.paths import Paths
from npuchat.engine.pull import pull
from npuchat.engine.session import ChatSession, SessionOptions

REPLY_TOKENS = 8


def second_turn(session: ChatSession, system: str, first: str, reply: str, user: str) -> Reply:
    """The second turn of a conversation (the one request `bench_timers.ask` does not cover)."""
    msgs = (ChatMessage("user", first), ChatMessage("assistant", reply), ChatMessage("user", user))
    request = ChatRequest(
        "b", system, msgs, SamplingParams(temperature=0.0, max_tokens=REPLY_TOKENS)
    )
    final = list(session.generate(request, threading.Event()))[-1]
    assert isinstance(final, Finished), final
    m = final.metrics
    return Reply(
        ids=[],
        wall_s=0.0,
        ttft_s=m.ttft_s,
        reused_tokens=m.reused_tokens,
        prefill_tokens=m.prefill_tokens,
        decode_tokens=m.decode_tokens,
        decode_tps=0.0,
        drafted=0,
        accepted=0,
        mean_accepted_len=0.0,
        draft_time_share=0.0,
    )


def open_session(model: str, cache: Path, kv_dtype: str) -> ChatSession:
    root = Path.home() / ".cache" / "npuchat-test"
    catalog = Catalog.load(Paths.from_env())
    try:
        path = catalog.resolve(model)
    except Exception:
        path, _ = pull(Catalog.load(Paths(root, root, root, root / "models")), model)
    # the app's keep-warm setting, so the idle case measures what a user gets
    opts = SessionOptions(keep_warm_s=KEEP_WARM_S)
    return ChatSession.open(
        path, name=model, cache_dir=cache, capacities=[2048], options=opts, kv_dtype=kv_dtype
    )


def child(model: str, cache: Path, system: str, kv_dtype: str) -> None:
    s = open_session(model, cache, kv_dtype)
    r = ask(s, system, "Review: def f(x): return x*2", REPLY_TOKENS)
    print(json.dumps({"ttft_s": r.ttft_s, "prefill": r.prefill_tokens, "reused": r.reused_tokens}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--idle", type=float, default=60.0)
    ap.add_argument("--kv-dtype", default="f32", choices=["f32", "f16", "int8"])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--system", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.model, args.cache, args.system, args.kv_dtype)
        return
    cache = Path(tempfile.mkdtemp(prefix="npuchat-bench-"))
    s = open_session(args.model, cache, args.kv_dtype)
    system = system_prompt(s, args.system_tokens, "prefix-reuse")
    rows: list[tuple[str, dict[str, float]]] = []

    def row(name: str, r: Reply) -> None:
        rows.append(
            (name, {"ttft_s": r.ttft_s, "prefill": r.prefill_tokens, "reused": r.reused_tokens})
        )

    row(
        "cold (first conversation)",
        ask(s, system, "Review: def add(a, b): return a+b", REPLY_TOKENS),
    )
    first = "Review: def sub(a, b): return a-b"
    shared = ask(s, system, first, REPLY_TOKENS)
    row("second conversation, same system prompt", shared)
    reply = s.tokenizer.decode(shared.ids)
    row(
        "second turn of that conversation",
        second_turn(s, system, first, reply, "And with type hints?"),
    )
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
            "--kv-dtype",
            args.kv_dtype,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    rows.append(("new process (prefix from disk)", json.loads(out.stdout.strip().splitlines()[-1])))
    hot = ask(s, system, "Review: def mul(a, b): return a*b", REPLY_TOKENS)
    row("hot, just before idling", hot)
    time.sleep(args.idle)
    idle = ask(s, system, "Review: def div(a, b): return a/b", REPLY_TOKENS)
    row(f"after {args.idle:.0f} s idle", idle)
    base = rows[0][1]["ttft_s"]
    n_system = len(s.system_prefix(system))
    print(f"model {args.model}, K/V {args.kv_dtype}, system prompt {n_system} tokens")
    print(f"{'case':42} {'TTFT s':>8} {'× cold':>7} {'prefill':>8} {'reused':>7}")
    for name, r in rows:
        t = r["ttft_s"]
        print(f"{name:42} {t:8.3f} {t / base:7.3f} {int(r['prefill']):8d} {int(r['reused']):7d}")
    print(f"idle / hot TTFT: {idle.ttft_s / hot.ttft_s:.2f}")


if __name__ == "__main__":
    main()
