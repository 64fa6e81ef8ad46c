"""Plain-text formatting of engine figures, shared by the metrics panel and reply footers."""

from __future__ import annotations

from datetime import datetime

from npuchat.engine.events import Metrics


def rate(tps: float) -> str:
    return f"{tps:,.1f} tok/s" if tps > 0 else "–"


def seconds(value: float) -> str:
    if value <= 0:
        return "–"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def count(n: int) -> str:
    return f"{n:,}"


def reply_summary(m: Metrics) -> str:
    """One line under a finished reply: what the user most wants to know about its speed."""
    parts = [f"TTFT {seconds(m.ttft_s)}"]
    if m.decode_tps > 0:
        parts.append(rate(m.decode_tps))
    tokens = m.decode_tokens + (1 if m.ttft_s > 0 else 0)
    parts.append(f"{count(tokens)} tok")
    return " · ".join(parts)


def prefilling(m: Metrics) -> bool:
    """The engine is still reading a long prompt (progress between prefill chunks)."""
    return 0 < m.prefill_tokens < m.prefill_total


def prefill_progress(m: Metrics) -> str:
    """ "reading the prompt: 1,280 / 3,842 tokens · about 23 s left"."""
    text = f"reading the prompt: {count(m.prefill_tokens)} / {count(m.prefill_total)} tokens"
    if m.prefill_tps > 0:
        left = (m.prefill_total - m.prefill_tokens) / m.prefill_tps
        text += f" · about {left:.0f} s left" if left >= 1 else " · almost done"
    return text


def acceptance(m: Metrics) -> str:
    if m.drafted == 0:
        return "–"
    text = f"{m.acceptance_rate:.0%}"
    if m.draft_k:
        text += f" (k={m.draft_k})"
    return text


def kv_text(m: Metrics) -> str:
    if m.kv_capacity <= 0:
        return "–"
    text = f"{count(m.kv_used)} / {count(m.kv_capacity)}"
    if m.kv_max_capacity > m.kv_capacity:
        text += f" (max {count(m.kv_max_capacity)})"
    return text


def kv_memory_text(m: Metrics) -> str:
    """ "3.2 of 26.0 MiB": this reply's K/V bytes, of what the cache holds now."""
    if m.kv_bytes_per_token <= 0:
        return "–"
    mib = 1024 * 1024
    return f"{m.kv_bytes_used / mib:,.1f} of {m.kv_bytes / mib:,.1f} MiB"


def kv_token_text(m: Metrics) -> str:
    """ "6.4 KiB int8": one token's K/V in every layer, and how the cache stores them."""
    if m.kv_bytes_per_token <= 0:
        return "–"
    return f"{m.kv_bytes_per_token / 1024:,.1f} KiB {m.kv_dtype}".rstrip()


def when(moment: datetime, now: datetime) -> str:
    """Short timestamp for the sidebar: the time today, else the date."""
    local, today = moment.astimezone(now.tzinfo), now
    if local.date() == today.date():
        return local.strftime("%H:%M")
    if local.year == today.year:
        return local.strftime("%b %d")
    return local.strftime("%Y-%m-%d")
