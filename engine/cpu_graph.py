"""The CPU's one decoder graph for a model: built once into the graph cache, opened as a session.

One graph with symbolic rows and capacity serves every CPU step, so a model has one session.
Its matmuls run on the native kernels when they can be built (`custom_ops`), reading the GGUF's
blocks where they lie in the model file (Q4_K rows regrouped, from the graph's weights file);
otherwise on `MatMulNBits`, which prepacks its weights once per load and whose no-longer-read
weight pages are given back (`process_memory`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnxruntime as ort  # type: ignore[import-untyped]

from .custom_ops import kernels_for
from .gguf_reader import ModelConfig
from .graph_inputs import GraphSpec
from .graph_key import BUILDER_VERSION, WEIGHTS_FILE, spec_digest
from .process_memory import releasing_file_pages
from .runtime import GraphCache, cache_key, create_session

__all__ = ["CpuGraph", "open_cpu_graph"]


@dataclass
class CpuGraph:
    folder: Path  # the graph's folder in the cache (its name keys the prefix store's layout)
    session: ort.InferenceSession
    kernels: str  # which matmul kernels it runs, for doctor (`custom_ops`)
    released_bytes: int  # weight-file pages given back once the session loaded


def open_cpu_graph(
    gguf: Path,
    cfg: ModelConfig,
    sha256: str,
    cache: GraphCache,
    *,
    accuracy_level: int,
    kv_dtype: str,
    threads: int | None,
    report: Callable[[str, float], None],
) -> CpuGraph:
    """Build (or reuse) the model's CPU graph in `cache` and open its session."""
    kernels = kernels_for(accuracy_level)
    ring = any(cfg.swa_layers)
    specs = {"decoder": GraphSpec.cpu(accuracy_level, kv_dtype, ring, kernels.available)}
    key = cache_key(sha256, spec_digest(specs), BUILDER_VERSION, "cpu", {})
    released = [0]

    def build(folder: Path) -> None:
        from .graph_builder import build_graphs  # `onnx`: only when building (`graph_key`)

        build_graphs(gguf, specs, folder, lambda f: report("building graphs", f))

    def open_session(folder: Path) -> ort.InferenceSession:
        report("loading graphs", 0.0)
        onnx_path = folder / "decoder.onnx"
        if kernels.available:  # the native kernels read every weight every step: keep them
            return create_session(onnx_path, "cpu", threads, kernels.path, gguf)
        with releasing_file_pages(folder / WEIGHTS_FILE) as freed:
            session = create_session(onnx_path, "cpu", threads, kernels.path, gguf)
        released[0] = freed[0]
        return session

    folder, session = cache.load(key, build, open_session, {"model": gguf.name, "sha256": sha256})
    return CpuGraph(folder, session, kernels.describe(), released[0])
