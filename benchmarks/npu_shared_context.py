"""One QNN context binary for a graph per step shape: its size, and whether it loads.

The engine runs one step graph instead (`engine/npu_compile.py`); this script keeps the measure
of the alternative, and `npu_shared_repro.py` reduces its crash to two one-op graphs.

QNN EP weight sharing (`ep.share_ep_contexts=1` on every compile session,
`ep.stop_share_ep_contexts=1` on the last, `enable_htp_weight_sharing=1`) writes one context
binary holding every graph with one copy of the weights; each `<graph>_ctx.onnx` points at it.
This script compiles a tiny synthetic model's graph set both ways (one binary per graph, as
`npu_compile` does, and shared), prints the bytes, then loads each shared graph in a child
process, since the load may crash the process. With onnxruntime-qnn 2.7.0 (QAIRT 2.51) on the
x86 HTP simulator: compiling works (the shared binary holds 3 graphs), and loading any graph
of a binary with two or more graphs dies with SIGSEGV inside libQnnHtp.so's context creation
(`QnnBackendManager::CreateContextHandleFromBinary`, a call through a null pointer), with or
without `ep.share_ep_contexts` at load; a shared binary holding one graph loads and runs.

    python benchmarks/npu_shared_context.py [--layers 2] [--d-model 512] [--graphs decode,prefill]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort  # type: ignore[import-untyped]
from npu_sources import htp_sources, shape_specs

from npuchat.engine.devices import QnnOptions, htp_device, qnn_versions
from npuchat.engine.npu_sizes import binary_bytes, gguf_tensor_bytes


def _options(shared: bool) -> dict[str, str]:
    opts = QnnOptions().provider_options()
    if shared:
        opts["enable_htp_weight_sharing"] = "1"
    return opts


def compile_set(sources: dict[str, Path], out: Path, shared: bool) -> None:
    out.mkdir(parents=True)
    for i, (name, src) in enumerate(sources.items()):
        so = ort.SessionOptions()
        so.log_severity_level = 3
        entries = {
            "session.disable_cpu_ep_fallback": "1",
            "ep.context_enable": "1",
            "ep.context_embed_mode": "0",
            "ep.context_file_path": str(out / f"{name}_ctx.onnx"),
            "ep.share_ep_contexts": "1" if shared else "0",
        }
        if shared and i == len(sources) - 1:
            entries["ep.stop_share_ep_contexts"] = "1"
        for key, value in entries.items():
            so.add_session_config_entry(key, value)
        so.add_provider_for_devices([htp_device()], _options(shared))
        ort.InferenceSession(str(src), so)


def load_and_run(ctx_model: Path) -> None:
    """Child process: load one EPContext model with sharing on and run it on zeros."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    so.add_session_config_entry("ep.share_ep_contexts", "1")
    so.add_provider_for_devices([htp_device()], _options(True))
    session = ort.InferenceSession(str(ctx_model), so)
    feeds = {
        i.name: np.zeros(i.shape, np.int64 if "int64" in i.type else np.float32)
        for i in session.get_inputs()
    }
    session.run(None, feeds)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--graphs", default="decode,prefill,verify")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        load_and_run(args.child)
        return 0
    print(f"onnxruntime-qnn {qnn_versions()[0]}, QAIRT {qnn_versions()[1]}")
    with tempfile.TemporaryDirectory(prefix="npu-shared-") as tmp_name:
        tmp = Path(tmp_name)
        specs = {n: s for n, s in shape_specs(16, 3, 64).items() if n in args.graphs.split(",")}
        gguf, sources = htp_sources(tmp, specs, args.layers, args.d_model)
        tensors = gguf_tensor_bytes(gguf)
        print(f"GGUF tensor bytes: {tensors:,}; graphs: {', '.join(sources)}")
        for shared in (False, True):
            out = tmp / ("shared" if shared else "separate")
            compile_set(sources, out, shared)
            bins = binary_bytes(out)
            total = sum(bins.values())
            label = "one shared binary" if shared else "one binary per graph"
            print(f"{label}: {total:,} bytes = {total / tensors:.2f}x tensor bytes {bins}")
        for name in sources:
            ctx = tmp / "shared" / f"{name}_ctx.onnx"
            res = subprocess.run(
                [sys.executable, __file__, "--child", str(ctx)], capture_output=True, text=True
            )
            verdict = "loads and runs" if res.returncode == 0 else f"exit code {res.returncode}"
            if res.returncode < 0:
                verdict = f"killed by signal {-res.returncode}"
            print(f"load shared {name}: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
