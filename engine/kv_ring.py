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

from .errors import NpuchatError
from .layer_inputs import MASK_NEG
from .model_config import ModelConfig

__all__ = ["RingFloors", "RingShape", "ring_rows", "usable_length"]


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


class RingFloors:
    """Each cache row's floor (module doc), and the lengths it makes usable. Without a ring
    (`ring` None) every length is usable and the floors stay 0."""

    def __init__(self, ring: RingShape | None, rows: int) -> None:
        self.ring = ring
        self.floor = [0] * rows

    def usable(self, n: int, row: int) -> int:
        """n if row `row` can continue from length n, else 0."""
        return usable_length(n, self.floor[row], self.ring.window) if self.ring else n

    def usable_prefix(self, n: int, ring_from: int) -> int:
        """The same for rows taken from slot 0 with `ring_from` (a snapshot's)."""
        return usable_length(n, ring_from, self.ring.window) if self.ring else n

    def written(self, row: int, end: int) -> None:
        """Positions up to `end` (exclusive) were written into the row's rings: the rows
        `end - R` and older are gone."""
        if self.ring is not None:
            self.floor[row] = max(self.floor[row], end - self.ring.size)

    def swap(self, a: int, b: int) -> None:
        self.floor[a], self.floor[b] = self.floor[b], self.floor[a]

    def for_import(self, row: int, at: int, end: int, ring_from: int) -> int:
        """The row's floor once a snapshot with `ring_from` fills `[at, end)`; an error when
        the rings could not continue from `end` then."""
        if self.ring is None:
            return 0
        floor = max(self.floor[row] if at else 0, ring_from, end - self.ring.size)
        if usable_length(end, floor, self.ring.window) != end:
            raise NpuchatError(
                f"the KV snapshot's sliding-window rows end before position {end}; prefill instead"
            )
        return floor
