"""`npuchat doctor`: what this machine offers, and where a model's graphs would run.

Without `--model` it lists the execution providers and devices ONNX Runtime reports, the
onnxruntime / onnxruntime-qnn / QAIRT versions, whether the QNN HTP is hardware or the x86
simulator, and what `--device auto` picks. With `--model NAME --device npu` it compiles the
model's NPU graphs (or loads them from the cache) exactly as a chat would, and reports each
graph's placement: every node on the NPU, or which nodes fall back and QNN's reason, and the
context binaries' bytes against the GGUF's tensor bytes (the copies of the weights). The exit
code is 1 when a graph is not 100% on the NPU, so scripts can check a model. With `--device cpu`
it builds or loads the CPU graph and reports what ONNX Runtime loaded.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from npuchat.engine import devices
from npuchat.engine.custom_ops import kernels_for
from npuchat.engine.draft_models import VERIFY_K
from npuchat.engine.errors import NpuchatError
from npuchat.engine.kv_layout import KV_AUTO, resolve_kv_dtype
from npuchat.engine.npu_sizes import describe

from .context import AppContext


def machine_report(ctx: AppContext) -> dict[str, Any]:
    from npuchat.app.cli import package_version

    status = devices.npu_status()
    pkg, qairt = devices.qnn_versions()
    auto, note = devices.resolve_device("auto")
    return {
        "versions": {
            "npuchat": package_version(),
            "onnxruntime": devices.onnxruntime_version(),
            "onnxruntime-qnn": pkg or "not installed",
            "qairt": qairt or "unknown",
        },
        "devices": [asdict(d) for d in devices.list_ep_devices()],
        "npu": {
            "available": status.available,
            "kind": status.kind,
            "simulated": status.simulated,
            "reason": status.reason,
            "soc_model": ctx.settings.soc_model,
            "htp_arch": ctx.settings.htp_arch,
        },
        "auto": {"device": auto, "note": note},
        "cpu_kernels": _cpu_kernels(),
        "cpu_kv_cache": _cpu_kv_cache(ctx.settings.kv_dtype),
    }


def _cpu_kernels() -> str:
    """Which matmul kernels a CPU model loads with (building the native ones if they are on)."""
    try:
        return kernels_for(4).describe()
    except NpuchatError as exc:
        return str(exc)


def _cpu_kv_cache(setting: str) -> str:
    """How a CPU model's cache stores K/V with the `kv_dtype` setting (what "auto" picks)."""
    try:
        dtype = resolve_kv_dtype(setting, "cpu", kernels_for(4).available)
    except NpuchatError as exc:
        return str(exc)
    return f"{dtype} (kv_dtype = {setting})" if setting == KV_AUTO else dtype


def model_report(ctx: AppContext, name: str, device: str, console: Console) -> dict[str, Any]:
    """Compile or load `name`'s graphs for `device` and describe where their nodes run."""
    from npuchat.engine.gguf_reader import GGUFFile
    from npuchat.engine.kv_ring import ring_rows
    from npuchat.engine.npu_compile import (
        NPU_STEP_ROWS,
        compile_npu_graphs,
        default_npu_capacity,
        explain_placement,
        npu_specs,
    )
    from npuchat.engine.npu_sizes import binary_sizes
    from npuchat.engine.runtime import GraphCache, model_sha256

    from .engine_factory import BATCH_MAX

    path = ctx.catalog.resolve(name)
    with GGUFFile(path) as g:
        cfg = g.config
    report: dict[str, Any] = {"model": name, "path": str(path), "arch": cfg.arch, "device": device}
    if device == "cpu":
        report["graphs"] = [_cpu_graph(ctx, path)]
        report["ok"] = True
        return report
    if not devices.npu_status().available:
        raise NpuchatError(f"--device npu: {devices.npu_status().reason}")
    opts = devices.QnnOptions(ctx.settings.soc_model, ctx.settings.htp_arch)
    capacity = default_npu_capacity(cfg.context_length)
    step = max(NPU_STEP_ROWS, VERIFY_K + 1)  # the graph a chat compiles (`Model.load`)
    ring = ring_rows(cfg, step, capacity)
    specs = npu_specs(NPU_STEP_ROWS, VERIFY_K, capacity, batch_max=BATCH_MAX["npu"], ring=ring)
    cache_dir = ctx.paths.cache_dir
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    with progress:
        task = progress.add_task("preparing", total=1.0)

        def show(stage: str, fraction: float) -> None:
            progress.update(task, description=stage, completed=fraction)

        try:
            compiled = compile_npu_graphs(
                path, model_sha256(path, cache_dir), specs, GraphCache(cache_dir), opts, show
            )
            placements, source = (
                compiled.placements,
                ("compiled now" if compiled.compiled else "from the cache"),
            )
            report["folder"] = str(compiled.folder)
            sizes = binary_sizes(compiled.folder, path)
            report["sizes"] = {
                "binaries": sizes.binaries,
                "binary_bytes": sizes.binary_bytes,
                "tensor_bytes": sizes.tensor_bytes,
                "ratio": round(sizes.ratio, 3),
            }
        except NpuchatError as exc:
            show("explaining placement", 0.0)
            placements, source = explain_placement(path, specs, opts), "not compiled"
            report["error"] = str(exc)
    report["binaries"] = source
    report["graphs"] = [
        {
            "graph": name,
            "seq_len": specs[name].seq_len,
            "batch": specs[name].batch,
            "capacity": specs[name].capacity,
            "nodes": p.total_nodes,
            "npu_nodes": p.npu_nodes,
            "npu_percent": round(100.0 * p.fraction, 1),
            "fallbacks": [asdict(f) for f in p.fallbacks],
            "ok": p.complete,
        }
        for name, p in placements.items()
    ]
    report["ok"] = all(g["ok"] for g in report["graphs"]) and "error" not in report
    return report


def _cpu_graph(ctx: AppContext, path: Path) -> dict[str, Any]:
    """Build or load the model's CPU graph as a chat would, and count what ONNX Runtime loaded.

    The CPU session has the CPU EP as its only provider, so a graph that loads runs every node
    there; what is worth reporting is that it loads, and what it holds.
    """
    import onnx

    from npuchat.engine.model import Model

    t0 = time.perf_counter()
    model = Model.load(
        path, cache_dir=ctx.paths.cache_dir, device="cpu", threads=ctx.settings.threads or None
    )
    try:
        seconds = time.perf_counter() - t0
        graph = onnx.load(str(model.graph_dir / "decoder.onnx"), load_external_data=False).graph
    finally:
        model.close()
    ops = Counter(node.op_type for node in graph.node)
    return {
        "graph": "decoder",
        "nodes": len(graph.node),
        "ops": dict(ops.most_common()),
        "load_s": round(seconds, 2),
        "ok": True,
    }


def _print(console: Console, machine: dict[str, Any], model: dict[str, Any] | None) -> None:
    for key, value in machine["versions"].items():
        console.print(f"[bold]{key:16}[/] {value}", highlight=False)
    table = Table(title="execution providers and devices", title_justify="left")
    for col in ("execution provider", "vendor", "device", "device vendor"):
        table.add_column(col)
    for d in machine["devices"]:
        table.add_row(d["ep_name"], d["ep_vendor"], d["hardware_type"], d["hardware_vendor"])
    console.print(table)
    npu = machine["npu"]
    line = npu["kind"] if npu["available"] else f"unavailable ({npu['reason']})"
    console.print(f"[bold]{'npu':16}[/] {line}", highlight=False)
    console.print(
        f"[bold]{'qnn target':16}[/] soc_model {npu['soc_model']}, htp_arch {npu['htp_arch']}",
        highlight=False,
    )
    console.print(f"[bold]{'--device auto':16}[/] {machine['auto']['note']}", highlight=False)
    console.print(f"[bold]{'cpu matmuls':16}[/] {machine['cpu_kernels']}", highlight=False)
    console.print(f"[bold]{'cpu K/V cache':16}[/] {machine['cpu_kv_cache']}", highlight=False)
    if model is None:
        return
    console.print(
        f"\n[bold]{model['model']}[/] ({model['arch']}) on {model['device']}"
        + (f" — binaries {model['binaries']}" if "binaries" in model else ""),
        highlight=False,
    )
    if model["device"] == "cpu":
        g = model["graphs"][0]
        top = ", ".join(f"{op} {n}" for op, n in list(g["ops"].items())[:6])
        console.print(
            f"  {g['graph']}: {g['nodes']} nodes ({top}, ...) loaded on the CPU EP in "
            f"{g['load_s']:.2f} s",
            highlight=False,
        )
        return
    table = Table(title_justify="left")
    for col in ("graph", "B", "S", "C", "nodes", "on NPU", "placement"):
        table.add_column(col, justify="left" if col in ("graph", "placement") else "right")
    for g in model["graphs"]:
        verdict = "100% NPU" if g["ok"] else f"{g['npu_percent']}% NPU"
        table.add_row(
            g["graph"],
            str(g.get("batch", 1)),
            str(g["seq_len"]),
            str(g["capacity"]),
            str(g["nodes"]),
            str(g["npu_nodes"]),
            verdict if g["ok"] else f"[red]{verdict}[/]",
        )
    console.print(table)
    if sizes := model.get("sizes"):
        line = describe(len(sizes["binaries"]), sizes["binary_bytes"], sizes["tensor_bytes"])
        console.print(f"  {line}", highlight=False)
    for g in model["graphs"]:
        for f in g["fallbacks"]:
            console.print(
                f"  [red]{g['graph']}: {f['node']} ({f['op_type']}) falls back[/]: {f['reason']}",
                highlight=False,
            )
    if "error" in model:
        console.print(f"[red]{model['error']}[/]", highlight=False)


def cmd_doctor(ctx: AppContext, args: argparse.Namespace, console: Console) -> int:
    machine = machine_report(ctx)
    model = None
    if args.doctor_model:
        model = model_report(ctx, args.doctor_model, args.doctor_device, console)
    if args.json:
        print(json.dumps({"machine": machine, "model": model}, indent=2))
    else:
        _print(console, machine, model)
    return 0 if model is None or model["ok"] else 1
