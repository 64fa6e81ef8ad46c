"""The live engine panel: what the engine is doing for this reply, updated while it streams.

It keeps the last reply's figures after the reply ends (and shows a stored reply's figures when
a conversation is opened), so a user can always see what the previous answer cost.
"""

from __future__ import annotations

from collections.abc import Sequence

from textual.app import ComposeResult
from textual.containers import Grid, VerticalScroll
from textual.reactive import reactive
from textual.widgets import Label, ProgressBar, Sparkline

from npuchat.app.tui.formatting import (
    acceptance,
    count,
    kv_memory_text,
    kv_text,
    kv_token_text,
    prefilling,
    rate,
    seconds,
)
from npuchat.engine.events import Metrics

# (row id, label); the value labels get id "m-<row id>".
_ROWS: tuple[tuple[str, str], ...] = (
    ("model", "model"),
    ("draft", "draft"),
    ("device", "device"),
    ("ttft", "TTFT"),
    ("prefill", "prefill"),
    ("reused", "reused"),
    ("decode", "decode"),
)


class MetricsPanel(VerticalScroll):
    """Figures from `Metrics`; colours come from the theme's npuchat-* variables (see tcss)."""

    state: reactive[str] = reactive("no reply yet", init=False)
    """Whether the figures are live, from the last reply, or absent (shown under them)."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = "Engine"
        self._engine = ("", "", "")

    def compose(self) -> ComposeResult:
        with Grid(classes="figures"):
            for row_id, label in _ROWS:
                yield Label(label, classes="metric-label")
                yield Label("–", id=f"m-{row_id}", classes="metric-value", markup=False)
        yield Sparkline([], id="rate-spark", summary_function=_mean)
        with Grid(classes="figures"):
            yield Label("KV", classes="metric-label")
            yield Label("–", id="m-kv", classes="metric-value", markup=False)
        memory = Grid(classes="figures", id="kv-memory")
        memory.display = False  # until a reply's metrics report the cache's bytes
        with memory:
            yield Label("KV mem", classes="metric-label")
            yield Label("–", id="m-kv-mem", classes="metric-value", markup=False)
            yield Label("per tok", classes="metric-label")
            yield Label("–", id="m-kv-token", classes="metric-value", markup=False)
        yield ProgressBar(id="kv-bar", show_eta=False, show_percentage=True, total=1)
        with Grid(classes="figures"):
            yield Label("accept", classes="metric-label")
            yield Label("–", id="m-accept", classes="metric-value", markup=False)
        yield Label(self.state, id="m-state", markup=False)

    def set_engine(self, model: str, draft: str, device: str) -> None:
        """What is loaded; shown until a reply's metrics name what actually ran."""
        self._engine = (model, draft, device)
        self._set("model", model or "–")
        self._set("draft", draft or "none")
        self._set("device", device or "–")

    def show(self, metrics: Metrics | None, rates: list[float], state: str) -> None:
        """Show one reply's figures; `state` says whether they are live or from the last reply."""
        self.state = state
        if metrics is None:
            for row_id in ("ttft", "prefill", "reused", "decode", "kv", "accept"):
                self._set(row_id, "–")
            self.query_one("#rate-spark", Sparkline).data = []
            self.query_one("#kv-bar", ProgressBar).update(total=1, progress=0)
            self.query_one("#kv-memory").display = False
            self.set_class(False, "-kv-full")
            return
        model, draft, device = self._engine
        self._set("model", metrics.model or model or "–")
        self._set("draft", metrics.draft or draft or "none")
        self._set("device", metrics.device or device or "–")
        self._set("ttft", seconds(metrics.ttft_s))
        done = count(metrics.prefill_tokens)
        if prefilling(metrics):
            done = f"{done} / {count(metrics.prefill_total)}"
        self._set("prefill", f"{done} tok · {rate(metrics.prefill_tps)}")
        self._set("reused", f"{count(metrics.reused_tokens)} tok")
        self._set("decode", f"{count(metrics.decode_tokens)} tok · {rate(metrics.decode_tps)}")
        self._set("kv", kv_text(metrics))
        self.query_one("#kv-memory").display = metrics.kv_bytes_per_token > 0
        self._set("kv-mem", kv_memory_text(metrics))
        self._set("kv-token", kv_token_text(metrics))
        self._set("accept", acceptance(metrics))
        self.query_one("#rate-spark", Sparkline).data = list(rates)
        bar = self.query_one("#kv-bar", ProgressBar)
        bar.update(total=max(1, metrics.kv_capacity), progress=metrics.kv_used)
        self.set_class(
            metrics.kv_capacity > 0 and metrics.kv_used >= 0.9 * metrics.kv_capacity, "-kv-full"
        )

    def watch_state(self, state: str) -> None:
        self.query_one("#m-state", Label).update(state)

    def _set(self, row_id: str, text: str) -> None:
        self.query_one(f"#m-{row_id}", Label).update(text)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0
