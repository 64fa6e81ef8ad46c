"""Reads a step trace of `concurrency.py --only paste --trace STEPS.log` and lists every engine
step beside the paste that cost more than `--over` (1.5) of the stream's usual step, by process
CPU time, with what it ran: which steps stretch the stream's longest gap, and why.

    python benchmarks/paste_trace.py STEPS.log [--over 1.5]

The paste beside the stream is the trace's last run of mixed steps; the usual step is the median
of the plain decode steps just before its first step that waited for or carried the prompt. Each
step is also set against the stream's plain decode steps nearest it (the stream grows meanwhile).
A script that prints figures, not a test.
"""

from __future__ import annotations

import argparse
import re
import statistics
from collections import Counter
from pathlib import Path

LINE = re.compile(
    r"step (\S+)\s+rows=(\d+) tokens=(\d+)\s+capacity=(\d+)->(\d+) wall=([\d.]+)ms cpu=([\d.]+)ms"
)
Step = tuple[str, int, int, int, int, float, float]  # kind, rows, tokens, cap, cap, wall, cpu


def parse(path: Path) -> list[Step]:
    out = []
    for line in path.read_text().splitlines():
        m = LINE.search(line)
        if m:
            k, r, n, c0, c1, w, c = m.groups()
            out.append((k, int(r), int(n), int(c0), int(c1), float(w), float(c)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("trace", type=Path)
    ap.add_argument("--over", type=float, default=1.5)
    args = ap.parse_args()
    steps = parse(args.trace)
    beside = {"mixed", "wait-room", "moved"}
    first = next(i for i, s in enumerate(steps) if s[0] in beside)
    while first > 0 and steps[first - 1][0] in beside | {"decode"} and steps[first - 1][1]:
        first -= 1  # back over the stream's decode steps before the paste came
    start = next(i for i in range(first, len(steps)) if steps[i][0] in beside)
    last = max(i for i, s in enumerate(steps) if s[0] in beside)
    end = min(len(steps), last + 4)  # and the few steps after the paste's last chunk
    usual = statistics.median(s[6] for s in steps[max(first, start - 12) : start])
    plain = [(i, steps[i][6]) for i in range(start, end) if steps[i][0] == "decode"]
    print(f"usual step {usual:.1f} ms CPU; {end - start} steps beside the paste:", end=" ")
    print(dict(Counter(f"{s[0]}/{s[2]}" for s in steps[start:end])))
    ratios = sorted(steps[i][6] / usual for i in range(start, end))
    print(f"CPU × usual: median {statistics.median(ratios):.2f}, max {ratios[-1]:.2f}")
    for i in range(start, end):
        kind, rows, tokens, c0, c1, wall, cpu = steps[i]
        near = sorted(plain, key=lambda p: abs(p[0] - i))[:9]
        own = cpu / statistics.median(c for _, c in near) if near else float("nan")
        if cpu > args.over * usual:
            print(
                f"  step {i - start:5d} {kind:9s} rows={rows} tokens={tokens:<3d} cap={c0}->{c1}"
                f"  cpu {cpu:6.1f} ms = {cpu / usual:.2f}x usual, {own:.2f}x nearest plain;"
                f" wall {wall:.1f} ms"
            )


if __name__ == "__main__":
    main()
