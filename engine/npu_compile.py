"""The NPU's static graph, compiled once into a QNN context binary and cached.

An NPU compiles a graph for fixed shapes. A model gets one graph, `step`: S rows for each of
its B KV slots at one capacity C (`npu_specs`), built by `graph_builder` with static shapes and
unfused norms (the HTP rejects `SkipSimplifiedLayerNormalization`), passed through
`npu_adapt.adapt_for_htp`, and compiled by the QNN EP into `step_ctx.onnx` plus its context binary
`step_ctx_qnn.bin` (embed mode 0), which holds the weights (quantized ones stay quantized).

Why one graph: every compiled graph carries its own copy of the weights, so a graph per step
shape (prefill, decode, verify, each batch size) cost ~3x the GGUF's bytes on disk and in the
NPU's memory. QNN's weight sharing (one binary for several graphs) compiles but the x86
simulator crashes loading it (`benchmarks/npu_shared_repro.py`), so the engine runs every step
through the one graph, left-padded (`npu_graphs`). A decode step then computes S·B rows for one
(16·2 by default): an NPU's matrix engine works on tiles of many rows and decode is bound by
reading the weights, so on the HTP this should cost little more than one row, as Genie's
fixed-length graphs assume; it could not be measured here (the simulator times the emulation,
not the HTP: `benchmarks/npu_profile.py`). On the simulator itself a step costs its rows.

Compiling is done with `session.disable_cpu_ep_fallback=1`: an op the HTP cannot run fails the
compile, and the error names the nodes and QNN's reason (`npu_placement.diagnose`), never a
silent CPU fallback. The compiled folder lives in the CPU graphs' verified cache
(`runtime.GraphCache`), keyed like them plus the QNN options and the QAIRT / onnxruntime-qnn
versions, so a corrupt or foreign `.bin` is rebuilt rather than handed to the HTP. The source
graph and weights are deleted once compiled. Where nodes run, and why not on the HTP, is
`npu_placement`.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import onnxruntime as ort  # type: ignore[import-untyped]

from .devices import QNN_EP, QnnOptions, qnn_versions
from .errors import NpuchatError
from .graph_inputs import GraphSpec
from .graph_key import BUILDER_VERSION, WEIGHTS_FILE, spec_digest
from .npu_placement import (
    GraphPlacement,
    describe_fallbacks,
    diagnose,
    first_line,
    new_session,
    session_options,
)
from .runtime import GraphCache, cache_key

# Bump when `adapt_for_htp` or the compiled folder's layout change (part of the cache key).
NPU_PASS_VERSION = "1"
PLACEMENT_FILE = "placement.json"
DEFAULT_NPU_CAPACITY = 2048
NPU_STEP_ROWS = 16  # the default prefill chunk on the NPU: the step graph's rows per slot

Progress = Callable[[str, float], None]


def npu_specs(
    prefill_chunk: int,
    verify_k: int,
    capacity: int,
    accuracy_level: int = 4,
    batch_max: int = 1,
    ring: int = 0,
    kv_dtype: str = "f32",
) -> dict[str, GraphSpec]:
    """The NPU's one graph, `step`: S = max(P, k+1) rows for each of the `batch_max` cache
    rows, at capacity C, with the logits of each entry's last k+1 rows; `ring`: the sliding
    layers' ring slots (`kv_ring`; 0: none); `kv_dtype`: the cache it reads, f32 or int8.

    One graph serves every step (prefill chunks, decode, verify, batched decode), left-padded
    (`npu_graphs`), so the set holds one copy of the weights (`npu_sizes`). Why one graph and
    not one per shape: module doc."""
    rows = max(prefill_chunk, verify_k + 1)
    logits = batch_max * (verify_k + 1)
    if kv_dtype not in ("f32", "int8"):
        raise NpuchatError(f"the NPU graph reads f32 or int8 K/V, not {kv_dtype}")
    spec = GraphSpec.static(rows, capacity, logits, accuracy_level, batch_max, ring, kv_dtype)
    return {"step": spec}


# --------------------------------------------------------------------------- compile


def compile_graph(src: Path, ctx_path: Path, opts: QnnOptions, name: str) -> GraphPlacement:
    """Compile `src` to the EPContext model `ctx_path` (+ its `.bin`), CPU fallback disabled.

    Returns the placement ONNX Runtime recorded (every node on the QNN EP, or the compile
    failed). A failure is diagnosed and raised as a one-line error naming the nodes.
    """
    so = session_options(opts, fallback=False)
    so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    so.add_session_config_entry("ep.context_enable", "1")
    so.add_session_config_entry("ep.context_embed_mode", "0")
    so.add_session_config_entry("ep.context_file_path", str(ctx_path))
    try:
        session = new_session(src, so)
    except Exception as exc:
        placement = diagnose(src, opts, name)
        if placement.fallbacks:
            raise NpuchatError(
                f"graph {name} does not compile for the NPU: {describe_fallbacks(placement)}; "
                "use --device cpu"
            ) from exc
        raise NpuchatError(
            f"the QNN EP failed to compile graph {name}: {first_line(exc)}; use --device cpu"
        ) from exc
    total = npu = 0
    for sub in session.get_provider_graph_assignment_info():
        n = len(sub.get_nodes())
        total += n
        npu += n if sub.ep_name == QNN_EP else 0
    del session
    if not ctx_path.exists():
        raise NpuchatError(f"the QNN EP wrote no context model for graph {name}; use --device cpu")
    return GraphPlacement(name, total, npu)


def npu_cache_key(model_sha: str, specs: Mapping[str, GraphSpec], opts: QnnOptions) -> str:
    """The CPU cache key's ingredients plus everything that changes a context binary."""
    pkg, qairt = qnn_versions()
    options = {"qnn": opts.key(), "onnxruntime_qnn": pkg, "qairt": qairt, "pass": NPU_PASS_VERSION}
    return cache_key(model_sha, spec_digest(specs), BUILDER_VERSION, "npu", options)


@dataclass
class CompiledGraphs:
    """A verified folder of context models, one per spec, and how it was obtained."""

    folder: Path
    specs: dict[str, GraphSpec]
    placements: dict[str, GraphPlacement]
    compiled: bool  # True if this call compiled (False: loaded from the cache)
    seconds: float

    def ctx_model(self, name: str) -> Path:
        return self.folder / f"{name}_ctx.onnx"


def compile_npu_graphs(
    gguf_path: Path,
    model_sha: str,
    specs: Mapping[str, GraphSpec],
    cache: GraphCache,
    opts: QnnOptions,
    progress: Progress | None = None,
) -> CompiledGraphs:
    """The compiled folder for `specs`, from the cache or compiled now (minutes for big models)."""
    report = progress or (lambda stage, fraction: None)
    key = npu_cache_key(model_sha, specs, opts)
    builds_before = cache.builds
    t0 = time.perf_counter()

    def build(folder: Path) -> None:
        from .graph_builder import build_graphs  # `onnx`: only when building (`graph_key`)
        from .npu_adapt import adapt_file_for_htp

        sources = build_graphs(gguf_path, specs, folder, lambda f: report("building graphs", f))
        placements = {}
        for i, (name, src) in enumerate(sources.items()):
            report(f"compiling {name} for the NPU", i / len(sources))
            adapt_file_for_htp(src)
            placements[name] = compile_graph(src, folder / f"{name}_ctx.onnx", opts, name)
            src.unlink()
        report("compiling for the NPU", 1.0)
        (folder / WEIGHTS_FILE).unlink()
        record = {name: p.as_dict() for name, p in placements.items()}
        (folder / PLACEMENT_FILE).write_text(json.dumps(record, indent=1))

    meta = {"specs": {k: v.key() for k, v in specs.items()}, "qnn": opts.provider_options()}
    folder = cache.get_or_build(key, build, meta)
    raw = json.loads((folder / PLACEMENT_FILE).read_text())
    placements = {name: GraphPlacement.from_dict(p) for name, p in raw.items()}
    return CompiledGraphs(
        folder,
        dict(specs),
        placements,
        cache.builds > builds_before,
        time.perf_counter() - t0,
    )


def explain_placement(
    gguf_path: Path, specs: Mapping[str, GraphSpec], opts: QnnOptions
) -> dict[str, GraphPlacement]:
    """Per graph, which nodes the HTP takes and why not the others (nothing is compiled).

    The explanation behind a failed compile: the graphs are built into a temporary folder,
    adapted as for compiling, and placed with CPU fallback allowed.
    """
    from .graph_builder import build_graphs
    from .npu_adapt import adapt_file_for_htp

    with tempfile.TemporaryDirectory(prefix="npuchat-placement-") as tmp:
        sources = build_graphs(gguf_path, specs, Path(tmp))
        out = {}
        for name, src in sources.items():
            adapt_file_for_htp(src)
            out[name] = diagnose(src, opts, name)
        return out


def default_npu_capacity(context_length: int) -> int:
    """One KV capacity for the NPU graph: each capacity would cost a compiled binary."""
    return max(1, min(context_length, DEFAULT_NPU_CAPACITY))


def load_compiled_session(path: Path, opts: QnnOptions) -> ort.InferenceSession:
    """A session over a compiled EPContext model, CPU fallback disabled."""
    try:
        return new_session(path, session_options(opts, fallback=False))
    except Exception as exc:
        raise NpuchatError(
            f"the NPU could not load {path.name} ({first_line(exc)}); "
            "delete the cache folder and start again"
        ) from exc
