"""Record llama.cpp's outputs on the synthetic GGUFs of the newer archs, as test data.

llama.cpp is the outside reference for architectures no real test model covers cheaply: the
synthetic files (tests/synthetic.py, deterministic) are run through llama.cpp's own library, and
its log-probabilities over a fixed token sequence (teacher-forced, every position) and its greedy
continuation of a prompt are written to `tests/data/llama-cpp-synthetic.json` with each file's
sha256, so CI compares the engine against them without building llama.cpp.

Needs the build of `benchmarks/build_llama_bench.sh` (shared libraries and the sdist's ctypes
bindings); run it as

    python benchmarks/llama_cpp_reference.py [--llama-dir ~/.cache/npuchat-bench/llama.cpp-0.3.36]

llama.cpp keeps its KV cache in fp16 and rounds activations to 8 bits before quantized matmuls,
so its numbers differ from the exact forward pass by that rounding (the test states its bounds).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import importlib
import json
import os
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from synthetic import write_synthetic_gguf  # noqa: E402
from synthetic_cases import LLAMA_CPP_CASES, case_tokens  # noqa: E402

OUT = ROOT / "tests" / "data" / "llama-cpp-synthetic.json"
TOP = 8  # log-probs kept per position
GREEDY_STEPS = 12


def bindings(llama_dir: Path) -> Any:
    """The sdist's low-level ctypes module, without its package's high-level imports."""
    os.environ["LLAMA_CPP_LIB_PATH"] = str(llama_dir / "build" / "bin")
    pkg = types.ModuleType("llama_cpp")
    pkg.__path__ = [str(llama_dir / "python-llama_cpp")]
    sys.modules["llama_cpp"] = pkg
    return importlib.import_module("llama_cpp.llama_cpp")


class Runner:
    """One llama.cpp context over a GGUF file; `kv_type` (a GGML type) sets the K and V cache
    types with flash attention on (llama.cpp quantizes V only under flash attention); `n_batch`
    bounds the rows of one `logits` call (default: the whole context)."""

    def __init__(
        self,
        lib: Any,
        path: Path,
        n_ctx: int,
        kv_type: int | None = None,
        threads: int = 2,
        n_batch: int | None = None,
    ) -> None:
        self.lib = lib
        mp = lib.llama_model_default_params()
        self.model = lib.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {path}")
        cp = lib.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = cp.n_ubatch = n_batch or n_ctx
        cp.n_threads = cp.n_threads_batch = threads
        if kv_type is not None:
            cp.type_k = cp.type_v = kv_type
            cp.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
        self.ctx = lib.llama_init_from_model(self.model, cp)
        vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = lib.llama_vocab_n_tokens(vocab)

    def logits(self, ids: list[int], start: int = 0) -> np.ndarray:
        """Feed `ids` at positions start.. in one batch; logits of every row."""
        lib = self.lib
        batch = lib.llama_batch_init(len(ids), 0, 1)
        for i, t in enumerate(ids):
            batch.token[i] = t
            batch.pos[i] = start + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 1
        batch.n_tokens = len(ids)
        if lib.llama_decode(self.ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        rows = []
        for i in range(len(ids)):
            ptr = lib.llama_get_logits_ith(self.ctx, i)
            rows.append(
                np.ctypeslib.as_array(
                    ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (self.n_vocab,)
                ).copy()
            )
        lib.llama_batch_free(batch)
        return np.stack(rows)

    def reset(self) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)

    def close(self) -> None:
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    z = x.astype(np.float64) - x.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = Path.home() / ".cache" / "npuchat-bench" / "llama.cpp-0.3.36"
    ap.add_argument("--llama-dir", type=Path, default=default)
    args = ap.parse_args()
    lib = bindings(args.llama_dir)
    lib.llama_backend_init()
    out: dict[str, Any] = {
        "source": f"llama.cpp from llama-cpp-python 0.3.36 ({args.llama_dir.name}), "
        "benchmarks/llama_cpp_reference.py; fp16 KV cache, CPU",
        "top": TOP,
        "cases": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name, (arch, tensor_type, kw) in LLAMA_CPP_CASES.items():
            path = write_synthetic_gguf(
                Path(tmp) / f"{name}.gguf", arch, tensor_type=tensor_type, **kw
            )
            sha = hashlib.sha256(path.read_bytes()).hexdigest()
            runner = Runner(lib, path, 128)
            seq = case_tokens(runner.n_vocab)
            lp = _log_softmax(runner.logits(seq))
            top = np.argsort(-lp, axis=-1)[:, :TOP]
            runner.reset()
            prompt = seq[:8]
            row = runner.logits(prompt)[-1]
            greedy = []
            for step in range(GREEDY_STEPS):
                greedy.append(int(row.argmax()))
                row = runner.logits([greedy[-1]], start=len(prompt) + step)[0]
            runner.close()
            out["cases"][name] = {
                "arch": arch,
                "tensor_type": tensor_type,
                "options": {k: v for k, v in kw.items() if k != "extra"},
                "gguf_sha256": sha,
                "tokens": seq,
                "top_ids": top.tolist(),
                "top_logprobs": np.round(np.take_along_axis(lp, top, -1), 5).tolist(),
                "greedy_prompt": prompt,
                "greedy_ids": greedy,
            }
            print(f"{name}: {len(seq)} positions, greedy {greedy}", file=sys.stderr)
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(OUT)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
