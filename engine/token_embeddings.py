"""The token embedding table, looked up on the host from the GGUF's own (quantized) bytes.

The graphs take embeddings as an input rather than a Gather over a table initializer: the
table stays quantized in the mapped GGUF and only the rows a step uses are ever decoded (a
150k-row table in float32 would cost more RAM than the rest of a small model). Single tokens
(decode) go through a small LRU of decoded rows: decoding one GGUF row costs ~0.3 ms of numpy
dispatch, a dictionary hit nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from gguf import GGMLQuantizationType

from .quant import dequantize_rows

__all__ = ["TokenEmbeddings"]

CACHE_ROWS = 1024


class TokenEmbeddings:
    """Rows of one GGUF embedding tensor (`raw` bytes of type `ggml_type`), `d_model` wide."""

    def __init__(self, raw: np.ndarray, ggml_type: GGMLQuantizationType, d_model: int) -> None:
        self._raw = raw
        self._type = ggml_type
        self._d = d_model
        self._rows: dict[int, np.ndarray] = {}

    def __call__(self, ids: Sequence[int]) -> np.ndarray:
        """Embeddings `[len(ids), d_model]`."""
        if len(ids) != 1:
            return self._decode(ids)
        row = self._rows.pop(ids[0], None)
        if row is None:
            row = self._decode(ids)
            if len(self._rows) >= CACHE_ROWS:
                del self._rows[next(iter(self._rows))]
        self._rows[ids[0]] = row  # most recent last
        return row

    def release(self) -> None:
        """Drop the view of the GGUF mapping (it must go before the file closes)."""
        self._raw = np.empty(0, np.uint8)
        self._rows.clear()

    def _decode(self, ids: Sequence[int]) -> np.ndarray:
        return dequantize_rows(self._raw, self._type, self._d, np.asarray(ids, dtype=np.int64))
