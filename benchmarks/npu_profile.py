"""What the QNN HTP simulator's profiler reports, and what one graph for every step would cost.

Runs a synthetic q4_0 model's static graphs on the HTP with the EP's `profiling_level=detailed`
(`profiling_file_path` gets a CSV: per-op and whole-graph "(cycles)" rows, and microseconds) and
prints, per graph and run: wall time, the profiler's execute time and cycles, cycles per
microsecond, and the context binary's bytes against the GGUF's tensor bytes. The graphs are
`decode` (S = 1), `prefill` (S = 16, last row's logits) and `step` (S = 16, every row's logits:
one graph that could serve prefill chunks, verify and decode, left-padded, with one copy of the
weights).

Measured with onnxruntime-qnn 2.7.0 / QAIRT 2.51 on the x86 simulator (2 cores, other work
running): the "cycles" follow the host's wall time at ~490-540 per microsecond for every
graph and vary run to run with the host's load (same inputs, up to 15% apart), so they time the
emulation, not the HTP: a modelled cycle count would be identical across runs. The simulator
gives no estimate of what a Snapdragon's HTP would take.

    python benchmarks/npu_profile.py [--runs 3] [--layers 2] [--d-model 512]
"""

from __future__ import annotations

import argparse
import csv
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort  # type: ignore[import-untyped]
from npu_sources import htp_sources

from npuchat.engine.devices import QnnOptions, htp_device, qnn_versions
from npuchat.engine.graph_builder import GraphSpec
from npuchat.engine.npu_compile import compile_graph
from npuchat.engine.npu_sizes import binary_bytes, gguf_tensor_bytes

CAPACITY = 256
ROWS = 16


def _feeds(session: ort.InferenceSession, seq_len: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds = {}
    for i in session.get_inputs():
        if "int64" in i.type:  # logit_rows: the last rows
            feeds[i.name] = np.arange(seq_len - i.shape[0], seq_len, dtype=np.int64)
        elif i.name == "mask":
            feeds[i.name] = np.zeros(i.shape, np.float32)
        else:
            feeds[i.name] = (0.1 * rng.standard_normal(i.shape)).astype(np.float32)
    return feeds


def profile(ctx_model: Path, seq_len: int, runs: int, csv_path: Path) -> None:
    opts = QnnOptions().provider_options()
    opts.update(profiling_level="detailed", profiling_file_path=str(csv_path))
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    so.add_provider_for_devices([htp_device()], opts)
    session = ort.InferenceSession(str(ctx_model), so)
    feeds = _feeds(session, seq_len)
    walls = []
    for _ in range(runs):
        t = time.perf_counter()
        session.run(None, feeds)
        walls.append(time.perf_counter() - t)
    del session  # the profile is written when the session ends
    rows = list(csv.reader(csv_path.open()))[1:]
    cycles = [int(r[2]) for r in rows if r[6] == "Accelerator (execute) time (cycles)"]
    micros = [int(r[2]) for r in rows if r[6] == "Accelerator (execute) time"]
    ops = sum(1 for r in rows if r[4] == "BACKEND" and r[0:2] == ["0", "NODE"])
    for wall, cyc, us in zip(walls, cycles, micros, strict=False):
        print(
            f"  wall {wall * 1e3:7.0f} ms  execute {us / 1e3:7.0f} ms  cycles {cyc:>13,}  "
            f"{cyc / us:5.0f} cycles/us"
        )
    print(f"  {ops} per-op cycle rows over {runs} runs")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=512)
    args = ap.parse_args()
    print(f"onnxruntime-qnn {qnn_versions()[0]}, QAIRT {qnn_versions()[1]}")
    specs = {
        "decode": GraphSpec.static(1, CAPACITY, 1, 0),
        "prefill": GraphSpec.static(ROWS, CAPACITY, 1, 0),
        "step": GraphSpec.static(ROWS, CAPACITY, ROWS, 0),
    }
    with tempfile.TemporaryDirectory(prefix="npu-profile-") as tmp_name:
        tmp = Path(tmp_name)
        gguf, sources = htp_sources(tmp, specs, args.layers, args.d_model)
        tensors = gguf_tensor_bytes(gguf)
        for name, src in sources.items():
            out = tmp / name
            out.mkdir()
            compile_graph(src, out / f"{name}_ctx.onnx", QnnOptions(), name)
            size = sum(binary_bytes(out).values())
            spec = specs[name]
            print(
                f"{name} (S {spec.seq_len}, {spec.logit_rows} logit rows): binary {size:,} bytes"
                f" = {size / tensors:.2f}x the GGUF's tensor bytes"
            )
            assert spec.seq_len is not None
            profile(out / f"{name}_ctx.onnx", spec.seq_len, args.runs, tmp / f"{name}.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
