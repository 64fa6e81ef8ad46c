"""The scripted session `chat_race.py` plays through both engines: fixed text, fixed order.

Three conversations share one system prompt of about 1,000 tokens (a coding assistant's house
rules, as an app would send with every request). Each conversation opens on a piece of code,
asks four questions and one of them is an edit ("reply with the whole function, changed"); the
user switches conversation after every turn, round robin, so every turn but the first three
comes back to a conversation another one interrupted. Only the user's side is fixed: each
engine's own greedy replies go into its conversation history.
"""

from __future__ import annotations

__all__ = ["CONVERSATIONS", "EDIT_TURNS", "ORDER", "SYSTEM_PROMPT"]

_RULES = [
    "You are the coding assistant of a small team that maintains a Python service for "
    "scheduling deliveries. You answer questions about code the user pastes, review it, and "
    "change it when asked. You are careful, direct and brief, and you never invent facts "
    "about libraries: when you are not sure how an API behaves, you say so and suggest how "
    "to check.",
    "Style of the code base. The project targets Python 3.11. Every function has type hints "
    "on its parameters and its return value. Names are written out in full: `customer`, not "
    "`cust`; `delivery_window`, not `dw`. Modules are small and named for what they hold. "
    "Docstrings say why a function exists and what a caller must know, not what each line "
    "does. Comments are short and true. Lines are at most 100 characters long. Imports are "
    "sorted: the standard library first, then third-party packages, then the project's own "
    "modules, each group separated by one blank line.",
    "Errors. A function that receives bad input raises `ValueError` with a message that names "
    "the value and says what was expected, in one line, for example `ValueError('weight must "
    "be positive, got -3.0')`. The code never catches `Exception` to hide a failure; it "
    "catches the narrowest exception it can handle and lets the rest propagate. Resources are "
    "released with `with` blocks. Retries use exponential backoff with a cap and give up "
    "after a bounded number of attempts, logging each failure at warning level.",
    "Data. Money is kept in integer cents, never in floats. Times are timezone-aware "
    "`datetime` objects in UTC inside the service and are converted to the customer's zone "
    "only when shown. Distances are in metres, weights in grams, durations in seconds, all as "
    "integers unless a fraction really matters. Identifiers are strings, not integers, "
    "because some of them come from partners who use letters. Collections passed between "
    "modules are tuples or frozen dataclasses, so nobody changes them by accident.",
    "Tests. Every change comes with a test that fails before it and passes after it. Tests "
    "use pytest, plain functions and plain asserts, and fixtures for anything that needs "
    "setting up. A test checks behaviour a user of the function would notice, not private "
    "details. Tests never sleep to wait for something; they use fakes for the clock and the "
    "network. Test names are sentences that say what must hold, such as "
    "`test_a_full_van_takes_no_more_parcels`.",
    "Performance. The service plans routes for up to two thousand parcels a day on one "
    "small machine, so clarity matters more than speed almost everywhere. When speed does "
    "matter, measure first with a benchmark that prints figures, then change the algorithm "
    "before tuning details. Avoid quadratic loops over parcels or stops. Prefer the "
    "standard library's `bisect`, `heapq`, `itertools` and `collections` over hand-written "
    "versions of the same thing.",
    "How to answer. When the user pastes code and asks a question, answer the question "
    "first, in plain sentences, and then give the detail. When you review, list the problems "
    "in order of importance, each with the line it concerns and a concrete fix. When the "
    "user asks for a change, reply with the whole changed function or class in one Python "
    "code block, keeping everything that did not need to change exactly as it was, including "
    "comments and blank lines, so the user can replace the old version in one paste. Do not "
    "explain the change at length unless asked; one sentence after the code is enough.",
    "Things to avoid. Do not suggest new dependencies when the standard library does the "
    "job. Do not rename things the user did not ask to rename. Do not reformat code that is "
    "not part of the change. Do not add logging, metrics or configuration options nobody "
    "asked for. Do not write placeholder code such as `pass` or `...` in place of a real "
    "implementation; if something cannot be done, say what is missing. Never print secrets, "
    "tokens or customer addresses in examples; use made-up values.",
    "Security and privacy. Customer names, addresses and phone numbers are personal data: "
    "they must not appear in logs, error messages or test fixtures taken from production. "
    "Inputs from partners are untrusted: validate their shape and size before use, and "
    "never pass them to `eval`, `pickle` or a shell. Files are opened with explicit "
    "encodings. Temporary files go in a directory created with `tempfile` and are removed "
    "when the work is done.",
    "When the user is unsure. If a question is ambiguous, answer the most likely reading "
    "and say in one sentence which reading you chose. If the code the user pastes has a bug "
    "they did not ask about, answer their question first and then mention the bug in one "
    "short paragraph at the end. Keep answers short: most questions deserve a few sentences "
    "and, if it helps, a short code example. These rules hold for every conversation.",
]

SYSTEM_PROMPT = "\n\n".join(_RULES)

_PACKING = '''```python
from dataclasses import dataclass


@dataclass(frozen=True)
class Parcel:
    parcel_id: str
    weight_grams: int
    volume_litres: int


def pack_vans(parcels: list[Parcel], max_weight: int, max_volume: int) -> list[list[Parcel]]:
    """Greedy first-fit: each parcel goes into the first van that still has room."""
    vans: list[list[Parcel]] = []
    loads: list[tuple[int, int]] = []
    for parcel in sorted(parcels, key=lambda p: p.weight_grams, reverse=True):
        for i, (weight, volume) in enumerate(loads):
            new_weight, new_volume = weight + parcel.weight_grams, volume + parcel.volume_litres
            if new_weight <= max_weight and new_volume <= max_volume:
                vans[i].append(parcel)
                loads[i] = (new_weight, new_volume)
                break
        else:
            vans.append([parcel])
            loads.append((parcel.weight_grams, parcel.volume_litres))
    return vans
```'''

_RETRY = '''```python
import logging
import time
import urllib.error
import urllib.request

log = logging.getLogger(__name__)


def fetch_schedule(url: str, attempts: int = 5) -> bytes:
    """The partner's delivery schedule; their server drops connections now and then."""
    delay = 1.0
    for attempt in range(attempts):
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return response.read()
        except urllib.error.URLError as exc:
            log.warning("schedule fetch %d failed: %s", attempt + 1, exc)
            time.sleep(delay)
            delay = delay * 2
    raise RuntimeError(f"could not fetch the schedule from {url}")
```'''

_WINDOWS = '''```python
from datetime import datetime, timedelta


def free_windows(
    booked: list[tuple[datetime, datetime]], day_start: datetime, day_end: datetime
) -> list[tuple[datetime, datetime]]:
    """The gaps of at least 30 minutes between booked delivery windows in one day."""
    gaps = []
    cursor = day_start
    for start, end in sorted(booked):
        if start - cursor >= timedelta(minutes=30):
            gaps.append((cursor, start))
        cursor = max(cursor, end)
    if day_end - cursor >= timedelta(minutes=30):
        gaps.append((cursor, day_end))
    return gaps
```'''

# Each conversation: four user messages, in order. The edit turns ask for the whole code back.
CONVERSATIONS: tuple[tuple[str, ...], ...] = (
    (
        "Here is how we pack parcels into vans:\n\n" + _PACKING + "\n\nWhy does it sort the "
        "parcels by weight first, and what goes wrong if two parcels are very bulky but light?",
        "Change `pack_vans` so that it sorts by whichever of weight or volume is the larger "
        "share of the van's limit, and rename `loads` to `van_loads`. Reply with the whole "
        "changed function.",
        "How would you test that no van is ever loaded past either limit? Describe two tests.",
        "Is first-fit good enough for two thousand parcels a day, or should we use something "
        "smarter? Explain the trade-off in a few sentences.",
    ),
    (
        "A partner's server keeps dropping our requests. This is our fetch code:\n\n"
        + _RETRY
        + "\n\nWhat does this code do when the partner is down for a whole minute?",
        "Does it follow our team's rules on retries? List what does not, in order of importance.",
        "Fix it: cap the delay at 8 seconds, do not sleep after the last attempt, and chain "
        "the last error into the RuntimeError. Reply with the whole changed function.",
        "How can I test this without waiting for real sleeps or a real network?",
    ),
    (
        "We offer customers the free delivery slots of a day with this function:\n\n"
        + _WINDOWS
        + "\n\nWhat happens if two booked windows overlap?",
        "What should it do with datetimes that are not timezone-aware, given our rules?",
        "Write two pytest tests for it: one with overlapping bookings and one with a booking "
        "that runs past the end of the day.",
        "Change it so the minimum gap is a parameter `min_gap: timedelta` defaulting to 30 "
        "minutes, and reject naive datetimes with a ValueError. Reply with the whole changed "
        "function.",
    ),
)

# The user's order: turn t of conversations 0, 1, 2, then turn t + 1 of each, ...
ORDER: tuple[tuple[int, int], ...] = tuple(
    (conv, turn) for turn in range(4) for conv in range(len(CONVERSATIONS))
)

EDIT_TURNS = frozenset({(0, 1), (1, 2), (2, 3)})  # (conversation, turn) of the code edits
