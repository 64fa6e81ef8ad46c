"""What `npuchat bench` runs: the prompt set and the two suites (`quick` for a look and the
tests, `full` for the README's figures). `benchmarks/speculative.py` uses the same prompts."""

from __future__ import annotations

from dataclasses import dataclass

EDIT_CODE = '''\
def compute_total(items, tax_rate):
    """Return the total price of the items, tax included."""
    subtotal = 0.0
    for item in items:
        price = item["price"]
        quantity = item.get("quantity", 1)
        subtotal += price * quantity
    tax = subtotal * tax_rate
    return round(subtotal + tax, 2)


def cheapest(items):
    """Return the cheapest item, or None for an empty list."""
    best = None
    for item in items:
        if best is None or item["price"] < best["price"]:
            best = item
    return best
'''

PROMPTS: dict[str, str] = {
    "code": "Write a Python function that merges two sorted lists into one sorted list, "
    "with a docstring and a few doctests.",
    "edit": "Rename `compute_total` to `total_price` and add type hints to both functions. "
    "Reply with the complete updated code only.\n\n```python\n" + EDIT_CODE + "```",
    "chat": "What are the main differences between TCP and UDP? Answer in a short paragraph.",
}


@dataclass(frozen=True)
class SuiteConfig:
    """How much to measure. `quick` is for a look (and tests); `full` feeds the README."""

    name: str
    prefill_sizes: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    decode_tokens: int  # timed decode steps per repeat
    repeats: int
    cold_repeats: int  # each one builds every graph again
    start_repeats: int  # cached starts (a new process each)
    reply_tokens: int  # max tokens of chat and speculation replies
    system_tokens: int  # length of the prefix-reuse system prompt
    prompts: tuple[str, ...]


SUITES: dict[str, SuiteConfig] = {
    "quick": SuiteConfig("quick", (128, 512), (128, 1024), 16, 3, 1, 2, 24, 256, tuple(PROMPTS)),
    "full": SuiteConfig(
        "full", (128, 512, 1024, 2048), (128, 1024, 2048), 64, 5, 2, 5, 128, 1000, tuple(PROMPTS)
    ),
}
SPEC_MODES = 4  # target, lookup, draft, both
BATCHED_STREAMS = (1, 2, 4)  # streams decoded together (the CPU engine's KV slots)
