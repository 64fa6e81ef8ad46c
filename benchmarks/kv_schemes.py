"""int8 K/V schemes compared on the numpy reference: perplexity and row error against f32 K/V.

    python benchmarks/kv_schemes.py MODEL.gguf [--tokens 768] [--calib 256]
        [--schemes head,block32,block16,calib_absmax,calib_rms,weights,weights_kv]

Every scheme quantizes each K (after RoPE) and V row on its own, as the cache must (decode and
verify of the same tokens stay identical), in `tests/reference_forward.py`'s float32 forward pass:

* `head`: one scale per (token, head), absmax/127;
* `block32` / `block16`: one scale per 32 / 16 values of a row (llama.cpp's q8_0 is block 32);
* `calib_absmax` / `calib_rms`: K divided by a per-channel power of two before `head`
  quantization and multiplied back after, the power from K's absmax / RMS per channel over a
  calibration text (the first `--calib` tokens of Python's `json/__init__.py`), the larger of
  each rotary pair, over the head's median, rounded down, at least 1;
* `weights`: the same with the power from the weights (`engine/kv_smoothing.py`, what the int8
  cache does); `weights_kv`: plus V smoothed by its calibration RMS (the output scaled back).

Perplexity is over the first `--tokens` tokens of Python's `argparse.py`; `errK`/`errV` are the
mean relative row errors ‖x̂ - x‖/‖x‖ over that text. A script that prints figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from reference_forward import ReferenceModel, log_softmax  # noqa: E402

Scheme = dict[str, tuple[int, Callable[[int], np.ndarray] | None]]  # kind -> (block, s(layer))


def quantize_rows(x: np.ndarray, block: int) -> np.ndarray:
    """Rows [heads, tokens, dh] rounded to int8 with one absmax/127 scale per `block` values."""
    h, t, d = x.shape
    xb = x.reshape(h, t, d // block, block)
    scale = np.maximum(np.abs(xb).max(-1, keepdims=True) / 127.0, 1e-30)
    return (np.clip(np.round(xb / scale), -127, 127) * scale).reshape(h, t, d)


class SchemeModel(ReferenceModel):
    """The reference with its K/V rows stored by `scheme` (None: f32), recording row errors."""

    scheme: Scheme | None = None
    record: dict[tuple[int, str], np.ndarray] | None = None
    errors: dict[str, list[float]]

    def _stored(self, x: np.ndarray, layer: int, kind: str) -> np.ndarray:
        if self.record is not None:
            self.record[(layer, kind)] = x.copy()
        if self.scheme is None:
            return x
        block, smooth = self.scheme[kind]
        s = smooth(layer)[:, None, :] if smooth is not None else 1.0
        y = quantize_rows(x / s, block) * s
        self.errors.setdefault(kind, []).append(float(np.linalg.norm(y - x) / np.linalg.norm(x)))
        return y


def powers(size: np.ndarray, neox: bool) -> np.ndarray:
    """Per-channel sizes [Hkv, dh] -> the smoothing powers of two (module doc)."""
    dh = size.shape[-1]
    i = np.arange(dh)
    size = np.maximum(size, size[:, (i + dh // 2) % dh if neox else i ^ 1])
    exp = np.floor(np.log2(size / np.median(size, axis=1, keepdims=True)))
    return 2.0 ** np.clip(exp, 0, 12)


def perplexity(model: SchemeModel, ids: list[int]) -> float:
    c = model.config
    h = model.hidden_states(ids)
    head = model.tensor("token_embd.weight" if c.tied_embeddings else "output.weight")
    nll = 0.0
    for start in range(0, len(ids) - 1, 128):
        rows = log_softmax((h[start : min(start + 128, len(ids) - 1)] @ head.T).astype(np.float64))
        target = np.asarray(ids[start + 1 : start + 1 + rows.shape[0]])
        nll -= float(rows[np.arange(len(target)), target].sum())
    return float(np.exp(nll / (len(ids) - 1)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--tokens", type=int, default=768)
    ap.add_argument("--calib", type=int, default=256)
    ap.add_argument(
        "--schemes", default="head,block32,block16,calib_absmax,calib_rms,weights,weights_kv"
    )
    args = ap.parse_args()

    from npuchat.engine.gguf_reader import GGUFFile
    from npuchat.engine.kv_smoothing import k_smoothing
    from npuchat.engine.tokenizer import Tokenizer

    path = args.model.expanduser()
    if not path.is_file():
        sys.exit(f"no GGUF file at {path}")
    with GGUFFile(path) as g:
        tok, from_weights = Tokenizer.from_gguf(g), k_smoothing(g)
    ids = tok.encode(Path(argparse.__file__).read_text())[: args.tokens]
    calib = tok.encode(Path(json.__file__).read_text())[: args.calib]
    model = SchemeModel(path, dtype=np.float32)
    model.record, model.errors = {}, {}
    model.hidden_states(calib)
    rec, model.record = model.record, None
    dh, neox = model.config.head_dim, model.rope_neox

    def calib_of(kind: str, stat: str) -> Callable[[int], np.ndarray]:
        def at(layer: int) -> np.ndarray:
            x = rec[(layer, kind)]
            size = np.abs(x).max(1) if stat == "absmax" else np.sqrt((x * x).mean(1))
            return powers(size, neox)

        return at

    schemes: dict[str, Scheme] = {
        "head": {"k": (dh, None), "v": (dh, None)},
        "block32": {"k": (32, None), "v": (32, None)},
        "block16": {"k": (16, None), "v": (16, None)},
        "calib_absmax": {"k": (dh, calib_of("k", "absmax")), "v": (dh, None)},
        "calib_rms": {"k": (dh, calib_of("k", "rms")), "v": (dh, None)},
        "weights": {"k": (dh, from_weights.__getitem__), "v": (dh, None)},
        "weights_kv": {"k": (dh, from_weights.__getitem__), "v": (dh, calib_of("v", "rms"))},
    }
    chosen = args.schemes.split(",")
    if unknown := set(chosen) - set(schemes):
        sys.exit(f"unknown schemes {sorted(unknown)}: use {', '.join(schemes)}")
    print(f"{path.name}: perplexity over {len(ids)} tokens of argparse.py; calib {len(calib)}")
    base = perplexity(model, ids)
    print(f"  {'f32':13} ppl {base:8.4f}")
    for name in chosen:
        t = time.perf_counter()
        model.scheme, model.errors = schemes[name], {}
        ppl = perplexity(model, ids)
        err = {k: float(np.mean(v)) for k, v in model.errors.items()}
        print(
            f"  {name:13} ppl {ppl:8.4f} {100 * (ppl / base - 1):+6.2f}%  errK {err['k']:.2e} "
            f"errV {err['v']:.2e}  ({time.perf_counter() - t:.0f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
