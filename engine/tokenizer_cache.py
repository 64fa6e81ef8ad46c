"""A built tokenizer kept on disk, so that a start reads it instead of building it again.

Building llama.cpp's SentencePiece tokenizer as a BPE lists every split of every piece as a
merge: gemma3's 262k pieces give 515k merges, ~3.2 s of Python and JSON on every start, where
reading the built tokenizer back is ~1.3 s. A byte-level BPE (Qwen2.5's 151k pieces) saves less
(its merges come ready in the GGUF), but still the JSON round trip.

The key is the model's sha256, the tokenizers library's version and a digest of the source of
the modules that decide what is built: a change to them is a new key, with no version number
to forget to bump. The file starts with a line holding the sha256 of the JSON after it, so a
damaged file is never used: it is built again and replaced (atomically), as the graph cache
does with a damaged folder. A cache that cannot be written costs only the build next time.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import tokenizers
from tokenizers import Tokenizer as HFTokenizer

from . import tokenizer_build, vocab_tables

HEADER = b"npuchat-tokenizer sha256="
MAX_FILE_BYTES = 256 * 1024 * 1024  # ~40x gemma3's 11 MB; a larger file is not ours

_SOURCES = (tokenizer_build, vocab_tables)


def _code_digest(extra: tuple[Path, ...]) -> str:
    h = hashlib.sha256(tokenizers.__version__.encode())
    for path in sorted({Path(str(m.__file__)) for m in _SOURCES} | set(extra)):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cache_file(folder: Path, model_sha256: str, *code: Path) -> Path:
    """Where the tokenizer of the model with this sha256 is kept; `code`: more source files
    whose every change must give a new key (the caller's own module)."""
    return folder / f"{model_sha256[:32]}-{_code_digest(code)}.json"


def _read(path: Path, pieces: int) -> HFTokenizer | None:
    """The tokenizer in `path` when the file holds together, else None."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError:
        return None
    head, _, body = raw.partition(b"\n")
    if len(raw) > MAX_FILE_BYTES or not head.startswith(HEADER):
        return None
    if head[len(HEADER) :] != hashlib.sha256(body).hexdigest().encode():
        return None
    try:
        hf = HFTokenizer.from_str(body.decode("utf-8"))
    except Exception:  # the library's error type is not exported
        return None
    return hf if hf.get_vocab_size(with_added_tokens=False) == pieces else None


def _write(path: Path, hf: HFTokenizer) -> None:
    body = hf.to_str().encode("utf-8")
    data = HEADER + hashlib.sha256(body).hexdigest().encode() + b"\n" + body
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        stem = path.name.split("-", 1)[0]
        for old in path.parent.glob(f"{stem}-*.json"):  # the same model under older code
            if old != path:
                old.unlink(missing_ok=True)
    except OSError:
        pass


def load_or_build(path: Path | None, pieces: int, build: Callable[[], HFTokenizer]) -> HFTokenizer:
    """The tokenizer kept at `path` (None: no cache), else `build()`'s, kept there.
    `pieces`: the vocabulary's distinct pieces, which a kept file's model must hold."""
    if path is None:
        return build()
    hf = _read(path, pieces)
    if hf is None:
        hf = build()
        _write(path, hf)
    return hf
