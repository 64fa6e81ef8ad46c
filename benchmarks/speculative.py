"""Speculative decoding on real models: target-only vs draft model vs prompt lookup vs both.

    python benchmarks/speculative.py [--model qwen2.5-coder-1.5b] [--draft qwen2.5-coder-0.5b]
        [--threads 2] [--tokens 128] [--modes target,draft,lookup,both,forced]
        [--prompts code,edit,chat,extract]

MODEL and DRAFT are GGUF paths or installed model names. One process loads the target and the
draft once; for every prompt the modes run back to back (same machine state), each mode keeping
one `SpeculativeDecoder` across prompts, as a chat session would (its cost model learns as it
goes). On a machine shared with other work, `--repeat N` keeps the fastest of N runs.
Greedy decoding, so every mode's tokens should equal target-only's: the table says whether they
do, and where they first differ. Decode tok/s counts the tokens after the first one over the
time after it (the draft's catch-up prefill is inside that time); `e2e` is all tokens over the
whole request.

`extract` asks for an order as JSON held to a schema (structured outputs): there the grammar's
forced tokens (each key's name) lead the draft and a drafter continues after them; `forced`
is the grammar's alone.

A script that prints figures, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from npuchat.engine.bench_suites import PROMPTS
from npuchat.engine.bench_timers import CHAT_SYSTEM, ask
from npuchat.engine.draft_models import VERIFY_K, load_draft_model
from npuchat.engine.drafters import Drafter, LookupDrafter
from npuchat.engine.session import ChatSession, SessionOptions
from npuchat.engine.speculative import SpeculativeDecoder


def _resolve(name: str) -> Path:
    path = Path(name).expanduser()
    if path.is_file():
        return path.resolve()
    from npuchat.engine.paths import Paths

    for folder in (Paths.from_env().models_dir, Path.home() / ".cache/npuchat-test/models"):
        if (folder / f"{name}.gguf").is_file():
            return folder / f"{name}.gguf"
    sys.exit(f"no GGUF at {name} and no installed model of that name")


EXTRACT = (
    "Extract the order as JSON.\n\nOrder #A-1042 was placed by Maria Gonzalez "
    "(maria.gonzalez@example.com) on 2026-11-28: 2 x 'USB-C cable, 2 m' at 9.99 EUR, "
    "1 x 'Laptop stand, aluminium' at 34.50 EUR and 3 x 'Notebook A5, dotted' at 4.20 EUR. "
    "Ship to Calle Mayor 14, 28013 Madrid, Spain, by express delivery."
)
_TEXT = {"type": "string"}
ORDER_SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "order_id": _TEXT,
            "customer": {
                "type": "object",
                "properties": {"name": _TEXT, "email": _TEXT},
                "required": ["name", "email"],
            },
            "date": _TEXT,
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "name": _TEXT,
                        "quantity": {"type": "integer"},
                        "unit_price": {"type": "number"},
                    },
                    "required": ["name", "quantity", "unit_price"],
                },
            },
            "currency": _TEXT,
            "address": {
                "type": "object",
                "properties": {"street": _TEXT, "postcode": _TEXT, "city": _TEXT, "country": _TEXT},
                "required": ["street", "postcode", "city", "country"],
            },
            "express": {"type": "boolean"},
        },
        "required": ["order_id", "customer", "date", "items", "currency", "address", "express"],
    }
)


def _run(session: ChatSession, prompt: str, tokens: int) -> tuple[list[int], dict[str, float]]:
    if prompt == "extract":
        r = ask(session, CHAT_SYSTEM, EXTRACT, tokens, json_schema=ORDER_SCHEMA)
    else:
        r = ask(session, CHAT_SYSTEM, PROMPTS[prompt], tokens)
    return r.ids, {
        "tps": r.decode_tps,
        "e2e": (r.decode_tokens + 1) / r.wall_s,
        "ttft": r.ttft_s,
        "drafted": r.drafted,
        "accepted": r.accepted,
        "mal": r.mean_accepted_len,
        "share": r.draft_time_share,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--modes", default="target,draft,lookup,both")
    ap.add_argument("--prompts", default="code,edit,chat")
    ap.add_argument("--cache-dir", type=Path, default=None)
    ap.add_argument(
        "--repeat", type=int, default=1, help="runs per prompt and mode; the fastest is shown"
    )
    args = ap.parse_args()
    modes = args.modes.split(",")
    cache = args.cache_dir or Path(tempfile.gettempdir()) / "npuchat-bench-cache"
    opts = SessionOptions(persist_prefixes=False)
    session = ChatSession.open(
        _resolve(args.model),
        name=args.model,
        cache_dir=cache,
        threads=args.threads,
        options=opts,
        verify_k=VERIFY_K,
    )
    model_drafter = None
    if any(m in ("draft", "both") for m in modes):  # one drafter: it knows what its cache holds
        model_drafter = load_draft_model(
            _resolve(args.draft), args.draft, session.model, cache_dir=cache, threads=args.threads
        )
    decoders: dict[str, SpeculativeDecoder | None] = {}
    for mode in modes:
        drafters: list[Drafter] = []
        if mode in ("lookup", "both"):
            drafters.append(LookupDrafter())
        if mode in ("draft", "both"):
            assert model_drafter is not None
            drafters.append(model_drafter)
        forced = mode == "forced"  # no drafter: only a grammar's forced tokens are drafted
        decoders[mode] = session.make_decoder(drafters) if drafters or forced else None

    print(f"{args.model} (draft {args.draft}), {args.threads} threads, {args.tokens} tokens")
    header = (
        f"{'prompt':6} {'mode':7} {'tok/s':>6} {'x':>5} {'e2e':>6} {'ttft':>5} "
        f"{'accept':>12} {'len':>5} {'draft%':>6} exact"
    )
    print(header)
    for pname in args.prompts.split(","):
        reference: list[int] | None = None
        base_tps = 0.0
        for mode in modes:
            runs = []
            with session.decoding_with(decoders[mode]):
                for _ in range(args.repeat):
                    # every run starts from an empty row (what the store keeps, the system
                    # prompt's rows, is reused alike by every run)
                    session.seq.rollback(0)
                    runs.append(_run(session, pname, args.tokens))
            ids, r = max(runs, key=lambda run: run[1]["tps"])
            if reference is None:
                reference, base_tps = ids, r["tps"]
                exact = "ref"
            else:
                pairs = enumerate(zip(ids, reference, strict=False))
                n = next((i for i, (a, b) in pairs if a != b), None)
                same = n is None and len(ids) == len(reference)
                exact = "yes" if same else f"no@{n if n is not None else len(reference)}"
            rate = f"{r['accepted']}/{r['drafted']}" if r["drafted"] else "-"
            print(
                f"{pname:6} {mode:7} {r['tps']:6.2f} {r['tps'] / base_tps:5.2f} {r['e2e']:6.2f} "
                f"{r['ttft']:5.2f} {rate:>12} {r['mal']:5.2f} {100 * r['share']:5.1f}% {exact}",
                flush=True,
            )
    for mode, dec in decoders.items():
        if dec is not None:
            c = dec.costs
            widths = ", ".join(f"{w}:{1000 * t:.0f}" for w, t in sorted(c.t_ver.items()))
            print(
                f"cost model [{mode}]: decode {1000 * (c.t_dec or 0):.0f} ms, verify ms by width "
                f"{{{widths}}}, acceptance {c.alpha}"
            )


if __name__ == "__main__":
    main()
