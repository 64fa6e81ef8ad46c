"""The inputs of a step whose rows bring different numbers of new tokens (a mixed step).

Rows shorter than the longest are left-padded: the pad positions are the slots just past the
row's own new tokens, which none of its tokens attend (they come after it) and later tokens
overwrite, so each real row is computed as in a step of its own (`Model.step_rows`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["left_padded"]


def left_padded(
    rows_ids: Sequence[Sequence[int]],
    starts: Sequence[int],
    embed: Callable[[Sequence[int]], np.ndarray],
    d_model: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Positions `[B, S]` and embeddings `[B, S, D]` of rows whose new tokens start at
    `starts`, each row's tokens last (S: the longest row); pad embeddings are zeros."""
    b, s = len(rows_ids), max(len(r) for r in rows_ids)
    pos = np.zeros((b, s), np.int64)
    emb = np.zeros((b, s, d_model), np.float32)
    for j, (row_ids, n) in enumerate(zip(rows_ids, starts, strict=True)):
        k = len(row_ids)
        pos[j] = np.concatenate([np.arange(n + k, n + s), np.arange(n, n + k)])
        emb[j, s - k :] = embed(row_ids)
    return pos, emb
