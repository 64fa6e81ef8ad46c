"""A user-level race: one scripted chat session through npuchat and through llama-server.

    python benchmarks/chat_race.py --model qwen2.5-coder-1.5b --threads 2 \\
        --llama-server ~/.cache/npuchat-bench/llama.cpp-0.3.36/build/bin/llama-server

The session (`chat_race_script`): 3 conversations x 4 turns sharing a ~1,000-token system
prompt, one code edit per conversation, the user switching conversation after every turn,
greedy replies of up to `--tokens` (128) tokens. npuchat runs as the app runs it: the engine
the app opens (`open_concurrent_engine`, its public `ChatEngine` port) with the app's defaults
(prefix reuse, lookup drafting). llama-server runs the same GGUF on the same threads with
`-np 3` (a slot per conversation, each request pinned to its slot) and `cache_prompt`. Each
side plays the script with its own replies in the history. Printed per turn: time to first
token, wall and process CPU time (what to compare on a loaded machine), tokens, and what each side
reused (npuchat: prompt tokens reused, lookup drafts accepted; llama-server: cached tokens); then
total wall and process CPU time of each side (the npuchat process; the llama-server process) and
their ratios, with the CPU model. Loading is not timed: npuchat builds
its graphs into a private cache first (so no prefixes of an earlier run exist), llama-server
answers /health first. One real-model process at a time: npuchat runs in a child process that
exits before llama-server starts.

MODEL is a catalog name installed in the models folder (NPUCHAT_HOME's, or `--models-dir`), or
the path of such a file. `--only npuchat|llama` runs one side. A script, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chat_race_script import CONVERSATIONS, EDIT_TURNS, ORDER, SYSTEM_PROMPT


@dataclass
class Turn:
    conv: int
    turn: int
    ttft_s: float
    wall_s: float
    tokens: int
    reply: str
    note: str = ""  # reused prompt tokens, drafted/accepted, llama's cached tokens
    cpu_s: float = 0.0  # the side's process CPU time over the turn: what to read under load
    ids: list[int] = field(default_factory=list)  # npuchat's reply token ids (lookup_replay)


def _history(conv: int, turn: int, replies: dict[tuple[int, int], str]) -> list[tuple[str, str]]:
    """(role, text) of conversation `conv` up to its user message `turn`."""
    msgs: list[tuple[str, str]] = []
    for t in range(turn):
        msgs += [("user", CONVERSATIONS[conv][t]), ("assistant", replies[(conv, t)])]
    return [*msgs, ("user", CONVERSATIONS[conv][turn])]


def _resolve(model: str, models_dir: str | None) -> tuple[str, Path]:
    """(catalog name, models folder) of `model`."""
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        return path.stem, path.resolve().parent
    if models_dir:
        return model, Path(models_dir).expanduser().resolve()
    from npuchat.engine.paths import Paths

    return model, Paths.from_env().models_dir


# ---------------------------------------------------------------- npuchat


def npuchat_side(name: str, models_dir: Path, threads: int, tokens: int) -> dict[str, Any]:
    """The script through the app's engine, in this process (a child of `main`)."""
    from npuchat.app.context import AppContext
    from npuchat.app.engine_factory import open_concurrent_engine
    from npuchat.app.engine_port import EngineSpec
    from npuchat.app.settings import Settings
    from npuchat.engine.catalog import Catalog
    from npuchat.engine.events import (
        ChatMessage,
        ChatRequest,
        Failed,
        Finished,
        SamplingParams,
        TokenDelta,
    )
    from npuchat.engine.paths import Paths

    root = Path(tempfile.mkdtemp(prefix="chat-race-"))
    paths = Paths(root / "config", root / "data", root / "cache", models_dir)
    ctx = AppContext(paths, Settings(threads=threads), {}, Catalog.load(paths))
    t = time.perf_counter()
    engine = open_concurrent_engine(ctx, EngineSpec(name, ctx.settings.draft, "cpu"))
    load_s = time.perf_counter() - t
    sampling = SamplingParams(temperature=0.0, max_tokens=tokens)
    replies: dict[tuple[int, int], str] = {}
    turns = []
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for conv, turn in ORDER:
        msgs = tuple(ChatMessage(r, text) for r, text in _history(conv, turn, replies))  # type: ignore[arg-type]
        request = ChatRequest(f"c{conv}", SYSTEM_PROMPT, msgs, sampling)
        start, first, text, note, ids = time.perf_counter(), 0.0, [], "", []
        cpu = time.process_time()
        for event in engine.generate(request, threading.Event()):
            if isinstance(event, TokenDelta):
                ids += event.ids
                if event.text:
                    first = first or time.perf_counter()
                    text.append(event.text)
            elif isinstance(event, Finished):
                m = event.metrics
                note = f"reused {m.reused_tokens}, drafted {m.drafted}/accepted {m.accepted}"
            elif isinstance(event, Failed):
                sys.exit(f"npuchat failed at conversation {conv} turn {turn}: {event.message}")
        end = time.perf_counter()
        replies[(conv, turn)] = "".join(text)
        ttft, reply = (first or end) - start, replies[(conv, turn)]
        cpu = time.process_time() - cpu
        turns.append(Turn(conv, turn, ttft, end - start, len(ids), reply, note, cpu, ids))
    cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
    figures = {
        "load_s": load_s,
        "wall_s": wall_s,
        "cpu_s": cpu_s,
        "turns": [asdict(x) for x in turns],
    }
    print(json.dumps(figures), flush=True)  # before the teardown
    engine.close()
    return figures


# ---------------------------------------------------------------- llama-server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _post_stream(url: str, body: dict[str, Any]) -> tuple[float, str, dict[str, Any]]:
    """(seconds to the first content, the content, the last chunk's timings) of one request."""
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    start, first, parts, timings = time.perf_counter(), 0.0, [], {}
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece:
                    first = first or time.perf_counter()
                    parts.append(piece)
            timings = chunk.get("timings", timings)
    return (first or time.perf_counter()) - start, "".join(parts), timings


def _wait_healthy(proc: subprocess.Popen[bytes], base: str, log: Any) -> None:
    while True:
        if proc.poll() is not None:
            log.seek(0)
            sys.exit(f"llama-server exited {proc.returncode}:\n{log.read()[-2000:].decode()}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.2)


def llama_side(server: str, gguf: Path, threads: int, tokens: int) -> dict[str, Any]:
    """The script through llama-server: 3 slots, each conversation pinned to its own."""
    port = _free_port()
    ctx = 3 * 4096  # each slot holds a whole conversation (~2,500 tokens at most)
    cmd = [server, "-m", str(gguf), "-np", "3", "-c", str(ctx), "-t", str(threads)]
    cmd += ["-tb", str(threads), "--host", "127.0.0.1", "--port", str(port)]
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            t = time.perf_counter()
            _wait_healthy(proc, base, log)
            load_s = time.perf_counter() - t
            replies: dict[tuple[int, int], str] = {}
            turns = []
            cpu0, wall0 = _proc_cpu_s(proc.pid), time.perf_counter()
            for conv, turn in ORDER:
                msgs = [{"role": "system", "content": SYSTEM_PROMPT}]
                msgs += [{"role": r, "content": c} for r, c in _history(conv, turn, replies)]
                body = {
                    "messages": msgs,
                    "stream": True,
                    "max_tokens": tokens,
                    "temperature": 0.0,
                    "top_k": 1,
                    "cache_prompt": True,
                    "id_slot": conv,
                }
                start, cpu = time.perf_counter(), _proc_cpu_s(proc.pid)
                ttft, text, timings = _post_stream(base + "/v1/chat/completions", body)
                wall = time.perf_counter() - start
                replies[(conv, turn)] = text
                note = (
                    f"cached {timings.get('cache_n', '?')}, prompt {timings.get('prompt_n', '?')}"
                )
                n = int(timings.get("predicted_n", 0))
                cpu = _proc_cpu_s(proc.pid) - cpu
                turns.append(Turn(conv, turn, ttft, wall, n, text, note, cpu))
            cpu_s, wall_s = _proc_cpu_s(proc.pid) - cpu0, time.perf_counter() - wall0
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    figures = [asdict(x) for x in turns]
    return {"load_s": load_s, "wall_s": wall_s, "cpu_s": cpu_s, "turns": figures}


# ---------------------------------------------------------------- report


def agreement(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> str:
    """How many turns' replies are the same text on both sides, and where the first differ.

    Both are greedy on the same weights, but two engines' float sums differ in order, so a
    near tie between two tokens can go either way; a conversation whose reply differed then
    goes on from different histories."""
    same = [a["reply"] == b["reply"] for a, b in zip(ours, theirs, strict=True)]
    line = f"replies the same text on both sides: {sum(same)} of {len(same)} turns"
    for a, b, ok in zip(ours, theirs, same, strict=True):
        if not ok:
            x, y = a["reply"], b["reply"]
            at = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), None)
            at = min(len(x), len(y)) if at is None else at
            return line + f" (first differs: c{a['conv']} t{a['turn']} at character {at})"
    return line


def report(npu: dict[str, Any] | None, llama: dict[str, Any] | None) -> None:
    sides = [(label, s) for label, s in (("npuchat", npu), ("llama-server", llama)) if s]
    head = "turn        " + "".join(f"{label:>30}" for label, _ in sides)
    units = "TTFT s  wall s  CPU s  tokens"
    print(head + "\n" + " " * 12 + "".join(f"{units:>30}" for _ in sides))
    for i, (conv, turn) in enumerate(ORDER):
        edit = " edit" if (conv, turn) in EDIT_TURNS else ""
        row = f"c{conv} t{turn}{edit:<6}"
        for _, s in sides:
            t = s["turns"][i]
            row += (
                f"{t['ttft_s']:>10.2f}{t['wall_s']:>8.2f}{t.get('cpu_s', 0):>7.1f}{t['tokens']:>6}"
            )
        print(row + "   " + "; ".join(s["turns"][i].get("note", "") for _, s in sides))
    for label, s in sides:
        tokens = sum(t["tokens"] for t in s["turns"])
        print(
            f"{label}: total wall {s['wall_s']:.1f} s, CPU {s['cpu_s']:.1f} s, {tokens} tokens"
            f" (load {s['load_s']:.1f} s, not counted)"
        )
    if npu and llama:
        print(agreement(npu["turns"], llama["turns"]))
        print(
            f"npuchat / llama-server: wall {npu['wall_s'] / llama['wall_s']:.2f}x, "
            f"CPU {npu['cpu_s'] / llama['cpu_s']:.2f}x (goal: wall <= 0.5x)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--models-dir")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--llama-server", metavar="PATH")
    ap.add_argument("--only", choices=["npuchat", "llama"])
    ap.add_argument("--json", metavar="FILE", help="write both sides' figures and replies")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    name, models_dir = _resolve(args.model, args.models_dir)
    if args.worker:
        npuchat_side(name, models_dir, args.threads, args.tokens)
        return
    if args.only != "npuchat" and not args.llama_server:
        sys.exit("--llama-server PATH is needed (benchmarks/build_llama_bench.sh --server)")
    from npuchat.engine.bench_timers import machine_info

    machine = machine_info()
    print(f"cpu: {machine.cpu} ({' '.join(machine.cpu_flags) or 'flags unknown'})")
    print(f"model {name}, threads {args.threads}, load average {os.getloadavg()[0]:.2f}")
    npu = llama = None
    if args.only != "llama":
        cmd = [sys.executable, __file__, "--worker", "--model", name]
        cmd += ["--models-dir", str(models_dir), "--threads", str(args.threads)]
        res = subprocess.run([*cmd, "--tokens", str(args.tokens)], capture_output=True, text=True)
        lines = res.stdout.strip().splitlines()
        if not lines or not lines[-1].startswith("{"):
            sys.exit(f"the npuchat side failed:\n{res.stderr[-2000:]}")
        npu = json.loads(lines[-1])
    if args.only != "npuchat":
        gguf = models_dir / f"{name}.gguf"
        llama = llama_side(os.path.expanduser(args.llama_server), gguf, args.threads, args.tokens)
    report(npu, llama)
    if args.json:
        Path(args.json).write_text(json.dumps({"npuchat": npu, "llama_server": llama}, indent=1))


if __name__ == "__main__":
    main()
