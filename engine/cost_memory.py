"""The speculation cost model's start figures, remembered per model, graphs, threads and machine.

A start measures a decode step and the widest verify steps before the first reply
(`SpeculativeDecoder.calibrate`: seven model steps, ~0.5 s of a 1.5B start on a 2-core
machine), so that the first rounds choose their draft length from measured costs. What the last
start on the same machine measured serves as well: the cost model keeps the lower quartile of
its recent samples and every step a reply runs adds one, so start figures only steer the first
rounds either way. But a verify width a reply never uses is never measured again, so figures
older than a day are measured again too (a machine's load changes: one measured while it was
busy would otherwise keep long drafts off). A file that does not hold together, or that was
measured for another model, graph set, thread count, draft length or CPU, is measured again and
rewritten; a cache that cannot be written only costs the measurement next time.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .speculative import CostModel

__all__ = ["recall", "remember"]

_LONGEST_S = 60.0  # no step takes longer: a figure beyond it is damage, not a measurement
_LARGEST = 1 << 16  # bytes: a file of figures is ~200; a bigger one is not read
_FRESH_S = 24 * 3600.0  # older figures are measured again


def _path(folder: Path, key: str) -> Path:
    return folder / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")


def _seconds(value: Any) -> float | None:
    ok = isinstance(value, float) and math.isfinite(value) and 0 < value < _LONGEST_S
    return value if ok else None


def recall(costs: CostModel, folder: Path, key: str) -> bool:
    """Give `costs` the figures remembered for `key`; False when there are none to trust."""
    path = _path(folder, key)
    try:
        st = path.stat()
        if st.st_size > _LARGEST or not 0 <= time.time() - st.st_mtime < _FRESH_S:
            return False
        raw = json.loads(path.read_text())
        decode, verify = _seconds(raw["decode_s"]), raw["verify_s"]
        widths = {int(w): _seconds(t) for w, t in verify.items()}
        ok = raw["key"] == key and decode is not None and bool(widths)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    if not ok or any(not 2 <= w <= costs.max_k + 1 or t is None for w, t in widths.items()):
        return False
    costs.record_decode(decode)  # type: ignore[arg-type]
    for width, t in sorted(widths.items()):
        costs.record_verify(width, t)  # type: ignore[arg-type]
    return True


def recall_or_measure(
    costs: CostModel, folder: Path | None, key: str, measure: Callable[[], None]
) -> None:
    """`costs` from the figures kept under `key`, else `measure()` them and keep what it
    found for the next start (`folder` None: measure, keep nothing)."""
    if folder is None or not recall(costs, folder, key):
        measure()
        if folder is not None:
            remember(costs, folder, key)


def remember(costs: CostModel, folder: Path, key: str) -> None:
    """Keep `costs`' current figures for the next start under `key` (written whole or not at
    all)."""
    if costs.t_dec is None or not costs.t_ver:
        return
    text = json.dumps(
        {
            "key": key,
            "decode_s": costs.t_dec,
            "verify_s": {str(w): t for w, t in sorted(costs.t_ver.items())},
        }
    )
    path = _path(folder, key)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
