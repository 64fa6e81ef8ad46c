"""KV cache dtypes on a real model: bytes per token, quality against f32, decode speed.

    python benchmarks/kv_quality.py MODEL [--dtypes f32,f16,int8] [--prompts 20] [--tokens 256]
        [--ppl-tokens 4096] [--contexts 128,2048,8192] [--threads 2] [--llama-dir DIR]

MODEL is a GGUF file. One model per dtype is loaded side by side (so memory is ~3 models' worth)
and all of them are stepped in lockstep:

* agreement: for each chat prompt, f32 decodes greedily for `--tokens` tokens; every other dtype
  is fed the same tokens (teacher forcing, in verify runs) and its argmax compared at each
  step. The first step where they differ is where free-running greedy output would first
  diverge; the f32 margin between its top two logits there says whether that step was a near
  tie. `top1` is the share of
  all steps whose argmax agrees (the steps after a divergence included, on f32's context);
* `KL`: the mean KL(f32 ‖ dtype) of the next-token distributions over those same steps;
* perplexity of a fixed text (`--text`; by default the source of Python's own `argparse`
  module: code, long, and the same for a given Python) over its first `--ppl-tokens` tokens,
  fed in verify runs of 32 rows; its delta against f32 in percent;
* decode tok/s at each context of `--contexts`, the dtypes alternating round by round so that a
  noisy machine slows all of them alike, by wall time and by process CPU time (steady under
  load with `--threads 1`); ratios against f32 from the same run.

With `--llama-dir` (the build of `benchmarks/build_llama_bench.sh`), the same agreement, KL and
perplexity figures for llama.cpp's q8_0 K/V cache (`-ctk q8_0 -ctv q8_0`) against its f16 one,
both with flash attention, fed the same token ids: the reference for "acceptable", over the
first `--llama-prompts` prompts. llama.cpp runs `--llama-threads` threads (default 1): its
threads spin at barriers, and with 2 threads on 2 busy shared cores a SmolLM2 decode step took
0.75-4.7 s instead of 0.1 s. `--parts` picks what runs (`quality,llama,speed`).

A script that prints figures, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash map is in two sentences.",
    "What does `git rebase` do, and when should I avoid it?",
    "Write a SQL query that returns the ten most recent orders per customer.",
    "Summarise the difference between a process and a thread.",
    "Write a bash one-liner that counts the lines of every .py file in a folder.",
    "How do I read a CSV file with pandas and drop rows with missing values?",
    "Give three tips for writing clear commit messages.",
    "Write a Rust function that reverses a vector in place.",
    "What is the time complexity of binary search, and why?",
    "Write a JavaScript debounce function.",
    "Explain the CAP theorem briefly.",
    "Write a C function that computes the length of a null-terminated string.",
    "What is a race condition? Give a small example.",
    "Write a Python class for a stack with push, pop and peek.",
    "How does HTTPS protect data in transit?",
    "Write a regular expression that matches an ISO date (YYYY-MM-DD).",
    "What is the difference between `==` and `is` in Python?",
    "Write a Go function that sums a slice of ints.",
    "Explain what a closure is, with a short example.",
]
VERIFY_ROWS = 32
NEAR_TIE = 0.5  # f32 top-2 logit margin below which a divergence counts as a near tie
DECODE_STEPS = 16


def _log_softmax(x: np.ndarray) -> np.ndarray:
    z = x.astype(np.float64) - x.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def _kl(p_log: np.ndarray, q_log: np.ndarray) -> float:
    return float((np.exp(p_log) * (p_log - q_log)).sum(axis=-1).mean())


class LlamaSide:
    """A llama.cpp context stepped like a `Model` (rollback to 0, prefill, decode, verify)."""

    def __init__(self, runner: Any) -> None:
        self.runner, self.pos = runner, 0

    def rollback(self, n: int) -> None:
        assert n == 0, "llama.cpp contexts here only restart"
        self.runner.reset()
        self.pos = 0

    def verify(self, ids: list[int]) -> np.ndarray:
        rows = self.runner.logits(ids, start=self.pos)
        self.pos += len(ids)
        return rows

    def prefill(self, ids: list[int]) -> np.ndarray:
        return self.verify(ids)[-1]

    def decode(self, token: int) -> np.ndarray:
        return self.verify([token])[0]


def agreement(models: dict, prompts: list[list[int]], tokens: int) -> dict[str, dict]:
    """Greedy agreement and mean KL of every dtype against the first one (module doc).

    The reference decodes greedily, step by step; the others read its tokens in verify runs of
    `VERIFY_ROWS` (a verify row equals a decode step bit for bit: the exactness the speculative
    decoder is tested on), ~10x cheaper than stepping them along."""
    ref_name = next(iter(models))
    out = {d: {"first": [], "ties": [], "top1": [], "kl": []} for d in models if d != ref_name}
    for ids in prompts:
        ref_model = models[ref_name]
        ref_model.rollback(0)
        rows, tops = [ref_model.prefill(ids)], []
        for step in range(tokens):
            tops.append(int(np.argmax(rows[-1])))
            if step + 1 < tokens:
                rows.append(ref_model.decode(tops[-1]))
        ref_logs = [_log_softmax(r) for r in rows]
        for d in out:
            m = models[d]
            m.rollback(0)
            theirs = [m.prefill(ids)]
            fed = tops[: tokens - 1]
            for start in range(0, len(fed), VERIFY_ROWS):
                theirs.extend(m.verify(fed[start : start + VERIFY_ROWS]))
            first = None
            for step, (ref, got) in enumerate(zip(rows, theirs, strict=True)):
                out[d]["kl"].append(_kl(ref_logs[step], _log_softmax(got)))
                agree = int(np.argmax(got)) == tops[step]
                out[d]["top1"].append(agree)
                if not agree and first is None:
                    first = step
                    two = np.sort(ref)[-2:]
                    out[d]["ties"].append(float(two[1] - two[0]))
            out[d]["first"].append(first)
    return out


def perplexity(models: dict, ids: list[int]) -> dict[str, float]:
    nll = dict.fromkeys(models, 0.0)
    for m in models.values():
        m.rollback(0)
    for start in range(0, len(ids) - 1, VERIFY_ROWS):
        chunk = ids[start : start + VERIFY_ROWS]
        target = ids[start + 1 : start + 1 + len(chunk)]
        for d, m in models.items():
            rows = _log_softmax(m.verify(chunk))[: len(target)]
            nll[d] -= float(rows[np.arange(len(target)), target].sum())
    return {d: float(np.exp(v / (len(ids) - 1))) for d, v in nll.items()}


def decode_speed(models: dict, context: int, rounds: int) -> dict[str, tuple[float, float]]:
    """Median decode tok/s at `context` by wall and by process CPU time, the dtypes alternating
    each round. CPU time is what to compare on a busy machine (with `--threads 1`: with more,
    ONNX Runtime's spinning workers add to it)."""
    vocab = next(iter(models.values())).config.vocab_size
    fill = [int(t) for t in np.random.default_rng(0).integers(0, vocab, context)]
    for m in models.values():
        m.rollback(0)
        m.prefill(fill)
    wall: dict[str, list[float]] = {d: [] for d in models}
    cpu: dict[str, list[float]] = {d: [] for d in models}
    for _ in range(rounds):
        for d, m in models.items():
            t, c = time.perf_counter(), time.process_time()
            for j in range(DECODE_STEPS):
                m.decode(fill[j])
            cpu[d].append(DECODE_STEPS / max(time.process_time() - c, 1e-9))
            wall[d].append(DECODE_STEPS / (time.perf_counter() - t))
            m.rollback(context)
    return {d: (statistics.median(wall[d]), statistics.median(cpu[d])) for d in models}


def quality(models: dict, prompts: list[list[int]], text_ids: list[int], tokens: int) -> None:
    """Print agreement, KL and perplexity of every model against the first one."""
    ref = next(iter(models))
    agree = agreement(models, prompts, tokens)
    ppl = perplexity(models, text_ids)
    print(f"\nquality against {ref}")
    print(
        f"  {'dtype':5} {'same greedy':>11} {'first div. (median, min)':>25} "
        f"{'top1':>6} {'mean KL':>9} {'ppl':>8} {'Δppl':>7}"
    )
    print(f"  {ref:5} {'':>11} {'':>25} {'':>6} {'':>9} {ppl[ref]:8.3f}")
    for d, a in agree.items():
        firsts = [f for f in a["first"] if f is not None]
        same = sum(f is None for f in a["first"])
        div = f"{statistics.median(firsts):.0f}, {min(firsts)}" if firsts else "-"
        delta = 100 * (ppl[d] / ppl[ref] - 1)
        print(
            f"  {d:5} {same:>5}/{len(prompts):<5} {div:>25} {np.mean(a['top1']):6.3f} "
            f"{np.mean(a['kl']):9.2e} {ppl[d]:8.3f} {delta:+6.2f}%"
        )
        if a["ties"]:
            near = sum(m < NEAR_TIE for m in a["ties"])
            margins = ", ".join(f"{m:.2f}" for m in a["ties"])
            print(f"        {ref} top-2 logit margin at each divergence: {margins}")
            print(f"        near ties (margin < {NEAR_TIE}): {near} of {len(a['ties'])}")


def llama_cpp(
    path: Path,
    llama_dir: Path,
    prompts: list[list[int]],
    text_ids: list[int],
    tokens: int,
    threads: int,
    n_ctx: int,
) -> None:
    """The same figures for llama.cpp's q8_0 K/V against its f16 K/V (module doc)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from llama_cpp_reference import Runner, bindings

    from npuchat.engine.gguf_reader import GGUFFile

    lib = bindings(llama_dir.expanduser())
    lib.llama_backend_init()
    types = {"f16": lib.GGML_TYPE_F16, "q8_0": lib.GGML_TYPE_Q8_0}
    runners = {d: Runner(lib, path, n_ctx, t, threads, n_batch=512) for d, t in types.items()}
    with GGUFFile(path) as g:
        cfg = g.config
    values = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim
    print(f"\nllama.cpp ({len(prompts)} prompts, flash attention, {threads} thread(s))")
    print(f"  KV bytes per token: f16 {2 * values:,d}, q8_0 ", end="")
    print(f"{values * 34 // 32:,d} (34 bytes per block of 32 values)")
    quality({d: LlamaSide(r) for d, r in runners.items()}, prompts, text_ids, tokens)
    for r in runners.values():
        r.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("model", type=Path, help="a GGUF file")
    ap.add_argument("--dtypes", default="f32,f16,int8")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--text", type=Path, default=Path(argparse.__file__))
    ap.add_argument("--contexts", default="128,2048,8192")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-dir", type=Path, default=None)
    ap.add_argument("--llama-dir", type=Path, default=None, help="llama.cpp build (module doc)")
    ap.add_argument("--llama-prompts", type=int, default=20)
    ap.add_argument("--llama-threads", type=int, default=1)
    ap.add_argument("--parts", default="quality,llama,speed")
    args = ap.parse_args()

    from npuchat.engine.chat_template import ChatTemplate
    from npuchat.engine.gguf_reader import GGUFFile
    from npuchat.engine.model import Model
    from npuchat.engine.tokenizer import Tokenizer

    path = args.model.expanduser()
    if not path.is_file():
        sys.exit(f"no GGUF file at {path}")
    dtypes = args.dtypes.split(",")
    if dtypes[0] != "f32":
        sys.exit("--dtypes must start with f32 (the reference)")
    contexts = [int(c) for c in args.contexts.split(",") if c]
    cache = args.cache_dir or Path(tempfile.gettempdir()) / "npuchat-kv-quality"
    with GGUFFile(path) as g:
        tok, template = Tokenizer.from_gguf(g), ChatTemplate.from_gguf(g)
    prompts = [
        tok.encode_chat(template.render_pieces([{"role": "user", "content": p}]))
        for p in PROMPTS[: args.prompts]
    ]
    text_ids = tok.encode(args.text.read_text())[: args.ppl_tokens]
    need = max([*contexts, len(text_ids), max(map(len, prompts)) + args.tokens]) + DECODE_STEPS
    models = {}
    for d in dtypes:
        models[d] = Model.load(
            path, cache_dir=cache, threads=args.threads, kv_dtype=d, verify_k=VERIFY_ROWS - 1
        )
        if need > models[d].max_capacity:
            sys.exit(f"the run needs {need} slots; the model holds {models[d].max_capacity}")

    print(
        f"{path.name}: {len(prompts)} prompts x {args.tokens} tokens, perplexity over "
        f"{len(text_ids)} tokens of {args.text.name}, {args.threads} threads"
    )
    base = models["f32"].kv_bytes_per_token
    print("\nKV bytes per token (all layers, K+V, int8 with its scales)")
    for d, m in models.items():
        print(f"  {d:5} {m.kv_bytes_per_token:8,d}  {m.kv_bytes_per_token / base:5.3f}x f32")

    parts = args.parts.split(",")
    if "quality" in parts:
        quality(models, prompts, text_ids, args.tokens)
    if args.llama_dir is not None and "llama" in parts:
        some = prompts[: args.llama_prompts]
        llama_cpp(path, args.llama_dir, some, text_ids, args.tokens, args.llama_threads, need)

    if "speed" in parts:
        print(
            f"\ndecode tok/s by wall and by process CPU time "
            f"(median of {args.rounds} rounds of {DECODE_STEPS} steps)"
        )
    for c in contexts if "speed" in parts else []:
        speed = decode_speed(models, c, args.rounds)
        w32, c32 = speed["f32"]
        cells = "  ".join(
            f"{d} {w:6.1f} ({w / w32:.2f}x) cpu {cp:6.1f} ({cp / c32:.2f}x)"
            for d, (w, cp) in speed.items()
        )
        print(f"  context {c:5}: {cells}")
    for m in models.values():
        m.close()


if __name__ == "__main__":
    main()
