"""K/V shared between the rows of one cache: a prompt that starts like another row's copies
those rows instead of prefilling them again.

vLLM shares prompt blocks between sequences (block-hash prefix caching); llama.cpp's server
gives a request the slot whose cache is most like its prompt. Rows here are fixed buffers, so
sharing is a copy, done once as a request starts (~5 ms for 2,000 tokens of the 0.5B model's
f16 K/V, warm, against ~6 s to prefill them on 2 cores). The prefix store only holds what a row left
behind (a conversation paged out, a system prompt); this covers what is still in a row: the
`n` choices of one request, an agent sending the same long few-shot prompt with different
questions, a client retrying a request whose first reply still streams.

Two requests that arrive together would each prefill the shared part side by side before
either could copy it. So a request first `claim`s its prompt: while another row is
prefilling a prompt that shares at least `MIN_SHARED` more tokens with it than any row holds,
it waits (polling; its row stays its own) until that prefill has written them, then copies.
A waiter has not claimed anything, so no two requests can wait for each other; a parked
sequence's prefill makes no progress, so nobody waits for one, nor, past `STALL_S`, for one
whose consumer stopped reading (its prefill runs only as its events are taken).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from contextlib import AbstractContextManager

from .prefix_store import PrefixHit, common_prefix_len
from .sequence import PARKED, Sequence

__all__ = ["MIN_SHARED", "STALL_S", "RowPeers"]

MIN_SHARED = 16  # fewer shared tokens than this are prefilled again rather than waited for
STALL_S = 5.0  # a prefill that writes no row for this long is not waited for any longer
_POLL_S = 0.01


class RowPeers:
    """The other sequences of `seq`'s cache, as a request starting on `seq` sees them.

    `others` lists them (rows' owners and parked sequences); `lock` is the one the prefix
    store is used under, so claims and copies are seen whole; `waits_for` says whose prefill
    this request may wait for (an interactive one not for a background one's: the scheduler
    runs that prefill at background pace)."""

    def __init__(
        self,
        seq: Sequence,
        others: Callable[[], list[Sequence]],
        lock: AbstractContextManager[object],
        waits_for: Callable[[Sequence], bool] = lambda _peer: True,
    ) -> None:
        self.seq = seq
        self._others = others
        self._lock = lock
        self._waits_for = waits_for

    def claim(self, ids: Seq[int], cancel: threading.Event) -> None:
        """Wait while another row prefills what `ids` could copy (module doc), then mark
        `ids` as the prompt `seq` is prefilling. `release` ends the claim.

        Which row to wait for, and for how many of its tokens, is decided once (comparing
        token lists takes the GIL from the steps); the wait then only reads its length."""
        with self._lock:
            target = self._prefilling(ids, len(ids) - 1)
            if target is None:
                self.seq.prompt = list(ids)
                return
        peer, prompt, n = target
        last, grew_at = -1, time.monotonic()
        while not cancel.is_set() and peer.prompt is prompt and peer.row != PARKED:
            have = len(peer.tokens)
            if have >= n:
                break
            if have > last:
                last, grew_at = have, time.monotonic()
            elif time.monotonic() - grew_at > STALL_S:
                break
            time.sleep(_POLL_S)
        with self._lock:
            self.seq.prompt = list(ids)

    def release(self) -> None:
        self.seq.prompt = []

    def _prefilling(self, ids: Seq[int], limit: int) -> tuple[Sequence, list[int], int] | None:
        """The row prefilling the longest prefix of `ids`, its prompt and that prefix's
        length, if it is at least `MIN_SHARED` longer than any row holds now."""
        held = common_prefix_len(self.seq.tokens, ids)
        found: tuple[Sequence, list[int], int] | None = None
        for peer in self._peers():
            held = max(held, common_prefix_len(list(peer.tokens), ids))
            prompt = peer.prompt
            if prompt and peer.row != PARKED and self._waits_for(peer):
                n = min(common_prefix_len(prompt, ids), limit)
                if found is None or n > found[2]:
                    found = (peer, prompt, n)
        if found is None or found[2] - min(held, limit) < MIN_SHARED:
            return None
        return found

    def best(self, ids: Seq[int], limit: int, beat: int) -> PrefixHit | None:
        """A copy of the longest usable prefix of `ids` (at most `limit` rows, more than
        `beat`) another row holds. Read under the runner's lock: a peer's `tokens` never run
        ahead of its rows there (a step writes its rows, then appends its tokens)."""
        with self.seq.runner.locked():
            found: tuple[int, Sequence] | None = None
            for peer in self._peers():
                n = peer.usable(min(common_prefix_len(peer.tokens, ids), limit))
                if n > beat and (found is None or n > found[0]):
                    found = (n, peer)
            if found is None:
                return None
            n, peer = found
            return PrefixHit(n, peer.kv_export(0, n), "row")

    def _peers(self) -> list[Sequence]:
        return [s for s in self._others() if s is not self.seq]
