"""Memory the sliding-window rings save: K/V bytes and resident memory of a full cache.

    python benchmarks/ring_memory.py MODEL [--capacity 8192] [--chunk 128] [--verify-k 4]

MODEL is a GGUF file with sliding-window layers (gemma3-270m: 15 of its 18 layers slide over
512 positions). For each layout, a fresh child process builds the model's KV cache at
`--capacity` and writes every slot of it (what a full conversation holds), then reports the
cache's bytes and how much its resident memory (VmRSS) grew:

* `full`: every layer keeps `capacity` rows (sliding layers see them through a mask);
* `ring`: sliding layers keep a ring of window + max(chunk, k+1) rows (what `Model` builds).

Then one `Model` is loaded at that capacity and prefilled past several wraps of its rings, and
its process RSS is printed beside its cache's bytes. A script that prints figures, not a test.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from npuchat.engine.gguf_reader import GGUFFile
from npuchat.engine.kvcache import KVCache
from npuchat.engine.model import Model

MIB = 1 << 20


def rss() -> int:
    """This process's resident bytes (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def child(model: Path, layout: str, capacity: int, steps: int) -> dict[str, int]:
    """Build the cache in this process, write every slot, and measure."""
    with GGUFFile(model) as g:
        cfg = g.config
    before = rss()
    if layout == "ring":
        kv = KVCache.for_model(cfg, [capacity], 1, "f32", steps)
    else:
        kv = KVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, [capacity])
    kv.data.fill(1.0)  # every page of every layer written, as a full cache has them
    return {"kv_bytes": kv.bytes_for(capacity), "rss_growth": rss() - before}


def model_figures(model: Path, capacity: int, chunk: int, verify_k: int) -> dict[str, int]:
    with (
        tempfile.TemporaryDirectory() as cache,
        Model.load(
            model,
            cache_dir=Path(cache),
            capacities=[capacity],
            prefill_chunk=chunk,
            verify_k=verify_k,
        ) as m,
    ):
        ids = [int(t) for t in np.random.default_rng(0).integers(3, 1000, 3 * 640)]
        m.prefill(ids)
        return {"kv_bytes": m.kv_bytes, "rss": rss(), "tokens": m.n_past}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--capacity", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--verify-k", type=int, default=4)
    ap.add_argument("--child", choices=["full", "ring"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    steps = max(args.chunk, args.verify_k + 1)
    if args.child:
        print(json.dumps(child(args.model, args.child, args.capacity, steps)))
        return
    rows = {}
    for layout in ("full", "ring"):
        cmd = [sys.executable, __file__, str(args.model), "--capacity", str(args.capacity)]
        cmd += ["--chunk", str(args.chunk), "--verify-k", str(args.verify_k), "--child", layout]
        rows[layout] = json.loads(subprocess.run(cmd, check=True, capture_output=True).stdout)
    print(f"K/V cache at capacity {args.capacity}, f32, every slot written:")
    for layout, r in rows.items():
        print(
            f"  {layout:5} {r['kv_bytes'] / MIB:8.1f} MiB K/V, "
            f"RSS grew {r['rss_growth'] / MIB:8.1f} MiB"
        )
    full, ring = rows["full"], rows["ring"]
    print(
        f"  ring / full: {ring['kv_bytes'] / full['kv_bytes']:.3f} of the bytes, "
        f"{(full['rss_growth'] - ring['rss_growth']) / MIB:.1f} MiB less resident"
    )
    m = model_figures(args.model, args.capacity, args.chunk, args.verify_k)
    print(
        f"Model at capacity {args.capacity} after {m['tokens']} prefilled tokens: "
        f"{m['kv_bytes'] / MIB:.1f} MiB K/V, process RSS {m['rss'] / MIB:.1f} MiB"
    )


if __name__ == "__main__":
    main()
