"""Turning a model name into a running engine: pull if needed, pick the device, load.

Shared by the TUI's loader, `npuchat run` and the benchmarks, so every front end resolves
names, devices and drafts the same way.
"""

from __future__ import annotations

from npuchat.engine.errors import NpuchatError
from npuchat.engine.pull import PullProgress, pull
from npuchat.engine.session import ChatSession

from .context import AppContext
from .engine_port import EngineLoader, EngineSpec, ProgressCallback

CPU_ONLY_NOTE = "the NPU device arrives with the NPU issue; use --device cpu or auto"


def resolve_device(requested: str) -> str:
    """`auto` means the CPU until NPU support lands: the x86 HTP simulator is far slower."""
    if requested in ("", "auto", "cpu"):
        return "cpu"
    if requested == "npu":
        raise NpuchatError(CPU_ONLY_NOTE)
    raise NpuchatError(f"unknown device {requested!r}; use npu, cpu or auto")


def check_draft(draft: str) -> None:
    """Only plain decoding exists so far; an explicit draft request is refused, not ignored."""
    if draft not in ("", "none"):
        raise NpuchatError(
            f"--draft {draft}: speculative decoding is not available yet; use --draft none"
        )


class _FractionPull:
    """Adapts pull progress (bytes) to the TUI's (stage, fraction) callback."""

    def __init__(self, report: ProgressCallback) -> None:
        self.report = report
        self.total = 0
        self.name = ""

    def start(self, name: str, total_bytes: int, parts: int) -> None:
        self.name, self.total = name, total_bytes
        self.report(f"pulling {name}", 0.0)

    def update(self, done_bytes: int, part: int) -> None:
        self.report(f"pulling {self.name}", done_bytes / self.total if self.total else 0.0)

    def finish(self) -> None:
        pass


def open_engine(
    ctx: AppContext,
    spec: EngineSpec,
    progress: ProgressCallback | None = None,
    *,
    pull_progress: PullProgress | None = None,
) -> ChatSession:
    report = progress or (lambda stage, fraction: None)
    check_draft(spec.draft)
    device = resolve_device(spec.device)
    path, _ = pull(ctx.catalog, spec.model, progress=pull_progress or _FractionPull(report))
    threads = ctx.settings.threads or None
    return ChatSession.open(
        path,
        name=spec.model,
        cache_dir=ctx.paths.cache_dir,
        device=device,
        threads=threads,
        progress=report,
    )


def make_loader(ctx: AppContext) -> EngineLoader:
    def load(spec: EngineSpec, progress: ProgressCallback) -> ChatSession:
        return open_engine(ctx, spec, progress)

    return load
