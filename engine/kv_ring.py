"""The ring a sliding-window layer keeps its K/V in: slots, masks, and which lengths it still holds.

A layer that sees only the last `window` positions (Gemma 3's local layers, Mistral-family files)
needs only that many rows. It keeps them in a ring of `R = window + step` slots, `step` being the
most rows one graph run writes (a prefill chunk, a verify, a mixed step's rows): position p lives
in slot `p mod R`. The extra `step` slots are what makes a step safe: its own new rows never
overwrite a row that one of its queries, or a rolled-back draft's next step, still attends
(llama.cpp sizes its SWA cache `n_swa + n_ubatch` for the same reason).

A ring forgets: once position `x + R` is written, row x is gone. So each cache row records its
*floor*, the first position whose ring rows are all still held, and a length n is usable (a
rollback target, a snapshot prefix to import) only when the window of the next position,
`[n - window + 1, n)`, lies above the floor. Reusing a shorter prefix than that would silently
attend wrong rows; the only other usable length is 0.
"""

from __future__ import annotations

import numpy as np

from .layer_inputs import MASK_NEG
from .model_config import ModelConfig

__all__ = ["RingShape", "ring_rows", "usable_length"]


def usable_length(n: int, floor: int, window: int) -> int:
    """`n` if a ring whose rows from `floor` on are held can continue from length n, else 0."""
    return n if n == 0 or max(0, n - window + 1) >= floor else 0


def ring_rows(cfg: ModelConfig, step: int, capacity: int) -> int:
    """Ring slots of `cfg`'s sliding layers at `capacity` (0: the model has none)."""
    if not any(cfg.swa_layers) or cfg.sliding_window <= 0:
        return 0
    return RingShape(cfg.sliding_window, step).rows(capacity)


class RingShape:
    """Slot arithmetic of one ring: `window` visible positions in `size` slots."""

    def __init__(self, window: int, step: int) -> None:
        self.window = int(window)
        self.size = int(window) + max(1, int(step))

    def rows(self, capacity: int) -> int:
        """Slots a ring layer holds at cache capacity C: the ring, or C when that is smaller
        (positions then never reach the ring's size, so slot = position)."""
        return min(self.size, capacity)

    def slots(self, positions: np.ndarray) -> np.ndarray:
        return positions % self.size

    def fill_inplace_mask(self, out: np.ndarray, positions: np.ndarray) -> None:
        """Mask `[B, 1, S, Rc]` over the ring after a step's rows were scattered into it: row p
        sees slot s when the position it holds, `p - ((p - s) mod R)`, is within the window
        and not negative. Slots of later rows of the same step are `R - j > window` behind."""
        b, s, rc = out.shape[0], out.shape[2], out.shape[3]
        pos = positions.reshape(b, s)[:, :, None]
        back = (pos - np.arange(rc)[None, None, :]) % self.size
        np.multiply((back >= self.window) | (back > pos), MASK_NEG, out=out[:, 0])

    def fill_split_mask(self, out: np.ndarray, first: int, start: int, pad: int) -> None:
        """Mask `[1, S, Rc + S]` (one batch entry) of the static layout: the ring is read before
        the step writes it, so row p (positions `first..`, the first `pad` padding) sees the
        slots of positions `[max(0, p - window + 1), start)` and the real new rows within its
        window up to itself; a padding row sees only itself."""
        s = out.shape[1]
        rc = out.shape[2] - s
        p = np.arange(first, first + s)[:, None]
        back = (p - np.arange(rc)[None, :]) % self.size
        held = p - back
        ring = (back < self.window) & (held >= 0) & (held < start)
        j = np.arange(s)[None, :]
        i = np.arange(s)[:, None]
        new = (j <= i) & (i - j < self.window) & (j >= pad)
        out[0, :, :rc] = np.where(ring & (i >= pad), 0.0, MASK_NEG)
        out[0, :, rc:] = np.where(new | (i == j), 0.0, MASK_NEG)
