"""npuchat's own figures: per reply in the response (`usage` and the `npuchat` extension), and
summed over the server's life as Prometheus text at `GET /metrics`.

The text format is written here (a few counters, gauges and one histogram) rather than pulled in
with a client library: it is a stable, line-based format and this is all of it we need.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from npuchat.engine.events import Metrics

from .runner import Load

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def prompt_tokens(m: Metrics) -> int:
    return m.prefill_tokens + m.reused_tokens


def usage(m: Metrics, completion_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object; reused prompt tokens are OpenAI's `cached_tokens`.
    `completion_tokens`: the ids the reply's text came from (the end-of-turn token excluded)."""
    p = prompt_tokens(m)
    return {
        "prompt_tokens": p,
        "completion_tokens": completion_tokens,
        "total_tokens": p + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": m.reused_tokens},
    }


def extension(m: Metrics) -> dict[str, Any]:
    """npuchat's figures for one reply (the `npuchat` field of a response)."""
    return {
        "ttft_s": round(m.ttft_s, 4),
        "prefill_tokens": m.prefill_tokens,
        "prefill_tps": round(m.prefill_tps, 2),
        "reused_tokens": m.reused_tokens,
        "decode_tokens": m.decode_tokens,
        "decode_tps": round(m.decode_tps, 2),
        "drafted": m.drafted,
        "accepted": m.accepted,
        "acceptance_rate": round(m.acceptance_rate, 4),
        "kv_used": m.kv_used,
        "kv_capacity": m.kv_capacity,
        "model": m.model,
        "draft": m.draft,
        "device": m.device,
    }


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@dataclass
class ServerMetrics:
    """Totals since start; `record_*` may be called from any task, so a lock guards them."""

    model: str
    draft: str
    device: str
    load: Load
    requests: Counter[tuple[str, int]] = field(default_factory=Counter)
    totals: Counter[str] = field(default_factory=Counter)
    ttft_buckets: list[int] = field(default_factory=lambda: [0] * len(TTFT_BUCKETS))
    ttft_sum: float = 0.0
    ttft_count: int = 0
    last_prefill_tps: float = 0.0
    last_decode_tps: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def record_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def record_reply(self, m: Metrics, completion_tokens: int) -> None:
        with self._lock:
            self.totals["prompt"] += prompt_tokens(m)
            self.totals["completion"] += completion_tokens
            self.totals["prefill"] += m.prefill_tokens
            self.totals["reused"] += m.reused_tokens
            self.totals["drafted"] += m.drafted
            self.totals["accepted"] += m.accepted
            if m.ttft_s > 0:
                self.ttft_sum += m.ttft_s
                self.ttft_count += 1
                for i, bound in enumerate(TTFT_BUCKETS):
                    if m.ttft_s <= bound:
                        self.ttft_buckets[i] += 1
            if m.prefill_tps > 0:
                self.last_prefill_tps = m.prefill_tps
            if m.decode_tps > 0:
                self.last_decode_tps = m.decode_tps

    def prometheus(self) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP npuchat_{name} {help_text}")
            lines.append(f"# TYPE npuchat_{name} {kind}")
            for labels, value in samples:
                lines.append(f"npuchat_{name}{labels} {value:g}")

        with self._lock:
            info = (
                f'{{model="{_label(self.model)}",draft="{_label(self.draft)}",'
                f'device="{_label(self.device)}"}}'
            )
            metric("info", "gauge", "The served model, its draft and device.", [(info, 1)])
            metric(
                "requests_total",
                "counter",
                "HTTP requests answered, by endpoint and status.",
                [
                    (f'{{endpoint="{_label(e)}",status="{s}"}}', n)
                    for (e, s), n in sorted(self.requests.items())
                ],
            )
            metric(
                "requests_running", "gauge", "Replies being generated.", [("", self.load.running)]
            )
            metric(
                "requests_waiting",
                "gauge",
                "Replies waiting for a slot.",
                [("", self.load.waiting)],
            )
            for key, help_text in (
                ("prompt", "Prompt tokens of finished replies (prefilled + reused)."),
                ("completion", "Tokens generated."),
                ("prefill", "Prompt tokens run through prefill."),
                ("reused", "Prompt tokens whose KV was reused instead of prefilled."),
                ("drafted", "Speculative draft tokens proposed."),
                ("accepted", "Speculative draft tokens accepted."),
            ):
                metric(f"{key}_tokens_total", "counter", help_text, [("", self.totals[key])])
            lines.append("# HELP npuchat_ttft_seconds Request to first token.")
            lines.append("# TYPE npuchat_ttft_seconds histogram")
            for bound, n in zip(TTFT_BUCKETS, self.ttft_buckets, strict=True):
                lines.append(f'npuchat_ttft_seconds_bucket{{le="{bound:g}"}} {n}')
            lines.append(f'npuchat_ttft_seconds_bucket{{le="+Inf"}} {self.ttft_count}')
            lines.append(f"npuchat_ttft_seconds_sum {self.ttft_sum:g}")
            lines.append(f"npuchat_ttft_seconds_count {self.ttft_count}")
            metric(
                "prefill_tokens_per_second",
                "gauge",
                "Prefill rate of the last reply that prefilled.",
                [("", self.last_prefill_tps)],
            )
            metric(
                "decode_tokens_per_second",
                "gauge",
                "Decode rate of the last reply that decoded.",
                [("", self.last_decode_tps)],
            )
        return "\n".join(lines) + "\n"
