"""GGUF files: metadata, tensor directory and the ModelConfig the graph builder needs.

`gguf.GGUFReader` parses every array element into Python objects and takes ~14 s to open a
150k-token vocabulary; a chat app cannot wait that long to tokenize one line. This reader parses
the header itself (numeric arrays via numpy, strings in one pass) and maps tensor data lazily, so
opening any of our models takes well under a second. Tensor *decoding* is left to `gguf.quants`.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .errors import NpuchatError, UnsupportedModelError

SUPPORTED_ARCHS = ("llama", "qwen2", "phi3")
_MAGIC = b"GGUF"

# GGUF value types -> (struct format, numpy dtype)
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"),
    1: ("<b", "<i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    7: ("<?", "?"),
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(NpuchatError):
    """The file is not a readable GGUF (truncated, wrong magic, unknown value type)."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's directory entry. `shape` is in GGML order (ne0 = innermost, contiguous)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    n_bytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1


class _Cursor:
    def __init__(self, buf: mmap.mmap | bytes, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.buf):
            raise GGUFFormatError(
                f"{self.path} is truncated (header runs past the end of the file): "
                "download or import it again"
            )
        out = self.buf[self.pos : end]
        self.pos = end
        return out

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        return self.take(n).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype][0])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype = self.scalar("<I")
            count = self.scalar("<Q")
            if etype in _SCALARS:
                dtype = np.dtype(_SCALARS[etype][1])
                raw = self.take(dtype.itemsize * count)
                return np.frombuffer(raw, dtype=dtype).copy()
            return [self.value(etype) for _ in range(count)]
        raise GGUFFormatError(f"{self.path}: unknown GGUF value type {vtype}; is it a GGUF file?")


class GGUFFile:
    """A GGUF file opened for reading: metadata dict, tensor directory, raw tensor bytes."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise NpuchatError(f"no such file: {self.path}")
        with open(self.path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as exc:  # empty file
                raise GGUFFormatError(f"{self.path} is empty, not a GGUF model") from exc
        cur = _Cursor(self._map, self.path)
        if cur.take(4) != _MAGIC:
            raise GGUFFormatError(f"{self.path} is not a GGUF file (bad magic bytes)")
        self.version = cur.scalar("<I")
        if self.version not in (2, 3):
            raise GGUFFormatError(f"{self.path}: GGUF version {self.version} is not supported")
        n_tensors = cur.scalar("<Q")
        n_kv = cur.scalar("<Q")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            meta[key] = cur.value(cur.scalar("<I"))
        self.metadata: Mapping[str, Any] = meta
        raw_infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("<I")
            dims = tuple(cur.scalar("<Q") for _ in range(n_dims))
            ttype = cur.scalar("<I")
            offset = cur.scalar("<Q")
            raw_infos.append((name, dims, ttype, offset))
        align = int(meta.get("general.alignment", 32))
        data_start = (cur.pos + align - 1) // align * align
        tensors: dict[str, TensorInfo] = {}
        for name, dims, ttype, offset in raw_infos:
            try:
                gtype = GGMLQuantizationType(ttype)
            except ValueError as exc:
                raise GGUFFormatError(
                    f"{self.path}: tensor {name} has unknown type {ttype}"
                ) from exc
            block, type_size = GGML_QUANT_SIZES[gtype]
            n_el = int(np.prod(dims)) if dims else 1
            n_bytes = n_el // block * type_size
            start = data_start + offset
            if start + n_bytes > len(self._map):
                raise GGUFFormatError(
                    f"{self.path} is truncated (tensor {name} runs past the end): "
                    "download or import it again"
                )
            tensors[name] = TensorInfo(name, dims, gtype, start, n_bytes)
        self.tensors: Mapping[str, TensorInfo] = tensors

    def close(self) -> None:
        self._map.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view into the mapped file (no copy)."""
        info = self.tensors[name]
        return np.frombuffer(self._map, dtype=np.uint8, count=info.n_bytes, offset=info.offset)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    @cached_property
    def config(self) -> ModelConfig:
        return ModelConfig.from_gguf(self)


@dataclass(frozen=True)
class RopeScaling:
    """Rope scaling as GGUF records it; type "none" for plain RoPE."""

    type: str = "none"
    factor: float = 1.0
    original_context_length: int = 0


@dataclass(frozen=True)
class ModelConfig:
    """Everything the graph builder and the reference forward pass need about a model."""

    arch: str
    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    context_length: int
    rope_theta: float
    rope_dim: int
    rope_scaling: RopeScaling
    rms_eps: float
    tied_embeddings: bool
    qkv_bias: bool
    fused_qkv: bool
    fused_gate_up: bool

    @property
    def n_groups(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.n_heads // self.n_kv_heads

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> ModelConfig:
        arch = g.architecture
        if arch not in SUPPORTED_ARCHS:
            raise UnsupportedModelError(
                f"{g.path.name}: architecture {arch or '(none)'!r} is not supported; "
                f"npuchat runs {', '.join(SUPPORTED_ARCHS)} models"
            )
        m = g.metadata

        def key(name: str, default: Any = None) -> Any:
            value = m.get(f"{arch}.{name}", default)
            if value is None:
                raise UnsupportedModelError(f"{g.path.name}: GGUF metadata lacks {arch}.{name}")
            return value

        d_model = int(key("embedding_length"))
        n_heads = int(key("attention.head_count"))
        n_kv = int(key("attention.head_count_kv", n_heads))
        head_dim = int(m.get(f"{arch}.attention.key_length", d_model // n_heads))
        t = g.tensors
        if "token_embd.weight" not in t:
            raise UnsupportedModelError(f"{g.path.name}: no token_embd.weight tensor")
        vocab = int(m.get(f"{arch}.vocab_size", t["token_embd.weight"].shape[1]))
        scaling_type = str(m.get(f"{arch}.rope.scaling.type", "none"))
        scaling = RopeScaling(
            type=scaling_type,
            factor=float(m.get(f"{arch}.rope.scaling.factor", 1.0)),
            original_context_length=int(m.get(f"{arch}.rope.scaling.original_context_length", 0)),
        )
        return cls(
            arch=arch,
            name=str(m.get("general.name", g.path.stem)),
            n_layers=int(key("block_count")),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            ffn_dim=int(key("feed_forward_length")),
            vocab_size=vocab,
            context_length=int(key("context_length")),
            rope_theta=float(m.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_dim=int(m.get(f"{arch}.rope.dimension_count", head_dim)),
            rope_scaling=scaling,
            rms_eps=float(key("attention.layer_norm_rms_epsilon")),
            tied_embeddings="output.weight" not in t,
            qkv_bias="blk.0.attn_q.bias" in t or "blk.0.attn_qkv.bias" in t,
            fused_qkv="blk.0.attn_qkv.weight" in t,
            fused_gate_up="blk.0.ffn_gate.weight" not in t,
        )


def read_config(path: str | Path) -> ModelConfig:
    with GGUFFile(path) as g:
        return g.config
