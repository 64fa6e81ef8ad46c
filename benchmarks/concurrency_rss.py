"""The peak-RSS figure of `concurrency.py`, measured in a child process of its own.

    python benchmarks/concurrency_rss.py MODEL.gguf CACHE SLOTS [--threads 2]

Kept apart because the child must start from a fresh process (its peak is the process's), and
because `concurrency.py` is long enough without it. The child loads the model with SLOTS slots at
capacity 4,096 from the graphs already built in CACHE and prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def status_mib(field: str) -> float:
    """A figure of /proc/self/status (VmRSS: resident now, VmHWM: the peak) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def rss_child(path: str, cache: str, slots: int, threads: int) -> None:
    """Load from the built graphs, then fill every slot to 4,096 and run a decode step over
    all of them: the peak of that (the load's own peak, from prepacking the weights, is reset
    first: it is the same for any number of slots and would hide the KV)."""
    from concurrency import open_engine

    engine = open_engine(Path(path), Path(cache), slots, threads, [4096])
    load_peak, loaded = status_mib("VmHWM"), status_mib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux)
    model = engine.model
    with engine.scheduler.locked():
        model._kv.data.fill(0.0)  # what a full cache holds
        for row in range(slots):
            model._kv.lengths[row] = 4095
        model.decode_batch([1] * slots)  # a step's own buffers at that shape
    print(
        json.dumps(
            {
                "load_peak_rss_mib": load_peak,
                "loaded_rss_mib": loaded,
                "peak_rss_mib": status_mib("VmHWM"),
                "kv_mib": model.kv_bytes / 2**20,
            }
        )
    )
    engine.close()


def rss(path: Path, cache: Path, slots: int, threads: int) -> dict[str, float]:
    cmd = [sys.executable, __file__, str(path), str(cache), str(slots)]
    cmd += ["--threads", str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if not lines or not lines[-1].startswith("{"):
        raise RuntimeError(f"the RSS child failed ({done.returncode}): {done.stderr[-2000:]}")
    if done.returncode:  # it measured, then failed on the way out
        print(f"  (the RSS child exited with {done.returncode}: {done.stderr.strip()[-200:]})")
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model")
    ap.add_argument("cache")
    ap.add_argument("slots", type=int)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    rss_child(args.model, args.cache, args.slots, args.threads)


if __name__ == "__main__":
    main()
