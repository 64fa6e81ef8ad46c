"""Turning a model name into a running engine: pull if needed, pick the device, load.

Shared by the TUI's loader, `npuchat run` and the benchmarks, so every front end resolves
names, devices and drafts the same way.
"""

from __future__ import annotations

from npuchat.engine import devices
from npuchat.engine.concurrent_engine import DEFAULT_QUEUE, ConcurrentEngine
from npuchat.engine.draft_models import VERIFY_K, load_draft_model
from npuchat.engine.drafters import Drafter, LookupDrafter
from npuchat.engine.errors import NpuchatError
from npuchat.engine.model import Model
from npuchat.engine.pull import PullProgress, pull
from npuchat.engine.session import ChatSession, SessionOptions

from .context import AppContext
from .engine_port import EngineLoader, EngineSpec, ProgressCallback

LOOKUP = "lookup"
KEEP_WARM_S = 20.0  # idle seconds between keep-warm ticks (see SessionOptions.keep_warm_s)
# KV slots (sequences decoded together). CPU: 4, decode reads the weights once for all rows
# and the cache is allocated at the smallest capacity that fits. NPU: 2, each batch variant is
# one more compiled context binary holding its own copy of the weights (DESIGN §5), and two
# streams (a reply and a background task) are what the app runs at once.
BATCH_MAX = {"cpu": 4, "npu": 2}


def parse_draft(draft: str) -> tuple[str | None, bool]:
    """`--draft` → (draft model name or None, use the lookup drafter).

    "" or "none" = plain decoding; "default" = the catalog's draft (if the model has one) plus
    lookup; "lookup"; "NAME"; "NAME+lookup". Every mode gives the target's own output (the
    `model` module doc says why verify and decode agree bit for bit).
    """
    text = draft.strip()
    if text == "default":
        return "", True
    if text in ("", "none"):
        return None, False
    parts = [p.strip() for p in text.split("+")]
    lookup = LOOKUP in parts
    names = [p for p in parts if p and p != LOOKUP]
    if len(names) > 1 or any(p == "" for p in parts) or "none" in names:
        raise NpuchatError(
            f"--draft {draft}: use none, lookup, a model name, or NAME+lookup (one draft model)"
        )
    return (names[0] if names else None), lookup


def check_draft(draft: str) -> None:
    """Refuse a malformed `--draft` before anything loads (names are checked when loading)."""
    parse_draft(draft)


def load_drafters(
    ctx: AppContext,
    model_name: str,
    target: Model,
    draft: str,
    report: ProgressCallback,
    pull_progress: PullProgress | None = None,
) -> list[Drafter]:
    """The drafters `draft` asks for, lookup first (free), then the draft model."""
    name, lookup = parse_draft(draft)
    drafters: list[Drafter] = [LookupDrafter()] if lookup else []
    if name == "":  # the catalog pairing, fetched like the model itself
        name = ctx.catalog.get(model_name).default_draft
        if name is None:
            return drafters
        path, _ = pull(ctx.catalog, name, progress=pull_progress or _FractionPull(report))
    elif name is not None:
        try:
            path = ctx.catalog.resolve(name)
        except NpuchatError as exc:
            raise NpuchatError(
                f"--draft {name}: {exc}; or use --draft lookup or --draft none"
            ) from None
    else:
        return drafters
    report(f"loading draft {name}", 0.0)
    # heterogeneous split: the draft may run elsewhere (`draft_device`); the loop stays on the host
    draft_device = ctx.settings.draft_device
    drafter = load_draft_model(
        path,
        name,
        target,
        cache_dir=ctx.paths.cache_dir,
        target_name=model_name,
        device=devices.pick_device(draft_device) if draft_device else None,
        threads=ctx.settings.threads or None,
        npu_options=devices.QnnOptions(ctx.settings.soc_model, ctx.settings.htp_arch),
        progress=report,
    )
    drafters.append(drafter)
    return drafters


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
    batch_max: int = 1,
    keep_warm_s: float = KEEP_WARM_S,
) -> ChatSession:
    """One model serving one reply at a time (the benchmarks measure this)."""
    report = progress or (lambda stage, fraction: None)
    check_draft(spec.draft)
    device = devices.pick_device(spec.device)
    path, _ = pull(ctx.catalog, spec.model, progress=pull_progress or _FractionPull(report))
    threads = ctx.settings.threads or None
    session = ChatSession.open(
        path,
        name=spec.model,
        cache_dir=ctx.paths.cache_dir,
        device=device,
        threads=threads,
        progress=report,
        verify_k=VERIFY_K,
        npu_options=devices.QnnOptions(ctx.settings.soc_model, ctx.settings.htp_arch),
        options=SessionOptions(keep_warm_s=keep_warm_s),
        batch_max=batch_max,
        kv_dtype=ctx.settings.kv_dtype,
        context=ctx.settings.context or None,
    )
    try:
        drafters = load_drafters(ctx, spec.model, session.model, spec.draft, report, pull_progress)
    except BaseException:
        session.close()
        raise
    session.use_drafters(drafters)
    return session


def open_concurrent_engine(
    ctx: AppContext,
    spec: EngineSpec,
    progress: ProgressCallback | None = None,
    *,
    pull_progress: PullProgress | None = None,
    max_queue: int = DEFAULT_QUEUE,
) -> ConcurrentEngine:
    """The engine the app, `npuchat run` and `npuchat serve` use: several requests at once on
    one model; `max_queue` requests may wait for a slot before more are refused as busy."""
    device = devices.pick_device(spec.device)
    session = open_engine(
        ctx,
        spec,
        progress,
        pull_progress=pull_progress,
        batch_max=BATCH_MAX.get(device, 1),
        keep_warm_s=0.0,  # the concurrent engine ticks itself, through its scheduler
    )
    return ConcurrentEngine(session, max_queue=max_queue, keep_warm_s=KEEP_WARM_S)


def make_loader(ctx: AppContext) -> EngineLoader:
    def load(spec: EngineSpec, progress: ProgressCallback) -> ConcurrentEngine:
        return open_concurrent_engine(ctx, spec, progress)

    return load
