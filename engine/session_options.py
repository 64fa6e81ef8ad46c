"""What a chat session is opened with beyond the model: the prefix store's RAM and whether it
persists, and the idle keep-warm tick. Apart from the session so the app's settings and the
benchmarks can build options without importing the session machinery."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MIN_PREFIX_BUDGET", "SessionOptions"]

MIN_PREFIX_BUDGET = 32 << 20


@dataclass(frozen=True)
class SessionOptions:
    # RAM for kept prefixes (other conversations, system prompts); None: a quarter of the model
    # file, at least MIN_PREFIX_BUDGET. A fixed 512 MiB let a long session of new conversations
    # grow a 98 MB model's process by hundreds of MB; tied to the model, it stays in the RSS
    # budget (1.3x the GGUF plus the KV cache). Evicted prefixes of system prompts stay on disk.
    prefix_budget_bytes: int | None = None
    persist_prefixes: bool = True
    # A chat app idles between turns, and this kind of machine reclaims pages left untouched for
    # ~60 s (the mapped weights, ORT's code); the next turn then faults them back in slowly. A
    # one-token decode (rolled back) every `keep_warm_s` of idleness keeps them resident for a
    # few ms of CPU. 0 (the default, for library use and tests) turns it off; the app sets it.
    # It only runs on the CPU (a simulated NPU step costs seconds).
    keep_warm_s: float = 0.0
