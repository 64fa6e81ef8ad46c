"""Load on `npuchat serve`: concurrent clients against the same requests sent one at a time.

    python benchmarks/serve_load.py [--model qwen2.5-coder-0.5b] [--clients 8] [--requests 10]
        [--engine concurrent|queued] [--batch 4]

Serves the model on 127.0.0.1 (an ephemeral port; nothing else is reachable), then sends the
same clients x requests greedy chat requests twice through the `openai` client, streaming:
first one at a time, then from `--clients` threads at once, each thread sending its requests
in turn. Prints p50/p95 TTFT (request sent -> first content chunk, as a client sees it) and
tok/s per client and in aggregate (all tokens / wall time), side by side, and checks that no
request failed and that every concurrent reply equals the same request's reply run alone (a
mixed-up or cross-talking response would differ). Bounded: at most `--timeout` seconds in all.
`--engine concurrent` (the default, what `npuchat serve` runs) serves them on the concurrent
engine with `--batch` KV slots; `--engine queued` on one session, one reply at a time, with
the server queueing the rest.

Every user message starts with a word whose first token no other message shares, so the KV
prefix a request can reuse from the one before it is the same in both runs (the system prompt
and the user header): the prompt is split into prefill chunks the same way, and greedy replies
are comparable token for token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import openai

from npuchat.app.serve.server import ServedModel, Server, create_app
from npuchat.engine.catalog import Catalog
from npuchat.engine.concurrent_engine import ConcurrentEngine
from npuchat.engine.paths import Paths
from npuchat.engine.pull import pull
from npuchat.engine.session import ChatSession

SYSTEM = "You are a helpful assistant. Answer in one or two short sentences."
_WORD_LIST = (  # one word per prompt
    "Apple Bridge Castle Dragon Engine Forest Garden Harbor Island Jungle Kettle Ladder "
    "Mirror Needle Ocean Pencil Quartz River Saddle Tunnel Umbrella Violin Window Yacht "
    "Zebra Anchor Basket Candle Desert Feather Glacier Hammer Igloo Jacket Kitten Lantern "
    "Magnet Nest Orchard Parrot Quilt Rocket Sandal Tiger Valley Walrus Yogurt Acorn Balloon "
    "Cactus Dolphin Eagle Falcon Guitar Helmet Insect Jigsaw Koala Lemon Meadow Noodle "
    "Octopus Piano Rabbit Shovel Tomato Unicorn Volcano Wagon Beetle Cherry Donkey Emerald "
    "Fountain Giraffe Hive Iris Jelly Lobster Mango Nutmeg Olive Penguin Raven Spider Turtle "
    "Vulture Walnut Badger Cobra Daisy "
    "Bicycle Compass Dinosaur Elephant Flamingo Gorilla Hamster Iceberg Jaguar Kangaroo "
    "Lighthouse Mushroom Nightingale Ostrich Pyramid Raccoon Satellite Telescope Uranium "
    "Vineyard Waterfall Xylophone Asteroid Blizzard Canyon Diamond Eclipse Fossil Geyser "
    "Hurricane Jellyfish Kiwi Lava Monsoon Nebula Oasis Pebble Quasar Rainbow Sapphire Tornado "
    "Whale Avocado Broccoli Cinnamon Dumpling Espresso Fig Garlic Hazelnut Ivory Jasmine "
    "Licorice Marble Nickel Oyster Pumpkin Radish Saffron Tulip Vanilla Wasp Zinc Bamboo "
    "Copper Denim Ember Flute Granite Harp Indigo Juniper Kayak Lotus Moss Nylon Opal Pine "
)
WORDS = _WORD_LIST.split()


@dataclass
class Result:
    key: int
    client: int
    ttft_s: float
    seconds: float
    tokens: int
    text: str
    error: str = ""


def pick_prompts(session: ChatSession, n: int) -> list[str]:
    """`n` user messages whose first tokens are all different (see the module doc)."""
    seen: set[int] = set()
    prompts = []
    for word in WORDS:
        first = session.tokenizer.encode(word)[0]
        if first in seen:
            continue
        seen.add(first)
        prompts.append(f"{word}: tell me one fact about a {word.lower()}.")
        if len(prompts) == n:
            return prompts
    raise SystemExit(f"only {len(prompts)} prompts with distinct first tokens; ask for fewer")


def send(client: openai.OpenAI, model: str, key: int, who: int, prompt: str, n: int) -> Result:
    t0 = time.perf_counter()
    ttft = 0.0
    text = ""
    tokens = 0
    try:
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}],
            temperature=0,
            max_tokens=n,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.delta.content:
                    ttft = ttft or time.perf_counter() - t0
                    text += choice.delta.content
    except openai.OpenAIError as exc:
        return Result(
            key, who, 0.0, time.perf_counter() - t0, 0, "", f"{type(exc).__name__}: {exc}"
        )
    return Result(key, who, ttft, time.perf_counter() - t0, tokens, text)


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(results: list[Result], wall_s: float, clients: int) -> dict[str, float]:
    ok = [r for r in results if not r.error]
    ttfts = [r.ttft_s for r in ok]
    per_client = []
    for c in range(clients):
        mine = [r for r in ok if r.client == c]
        busy = sum(r.seconds for r in mine)
        per_client.append(sum(r.tokens for r in mine) / busy if busy else 0.0)
    return {
        "ttft_p50_s": pct(ttfts, 0.5),
        "ttft_p95_s": pct(ttfts, 0.95),
        "client_tps_median": statistics.median(per_client),
        "aggregate_tps": sum(r.tokens for r in ok) / wall_s if wall_s else 0.0,
        "wall_s": wall_s,
        "failed": len(results) - len(ok),
    }


def model_path(name: str, gguf: Path | None) -> Path:
    if gguf is not None:
        return gguf
    try:
        return Catalog.load(Paths.from_env()).resolve(name)
    except Exception:  # not installed in the user's folders: the test cache has it
        root = Path.home() / ".cache" / "npuchat-test"
        return pull(Catalog.load(Paths(root, root, root, root / "models")), name)[0]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--gguf", type=Path, help="GGUF file (default: the catalog's)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=10, help="per client")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--capacity", type=int, default=1024)
    ap.add_argument("--engine", choices=["concurrent", "queued"], default="concurrent")
    ap.add_argument("--batch", type=int, default=4, help="KV slots of the concurrent engine")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole run")
    ap.add_argument("--json", type=Path, help="write the figures and every reply here")
    args = ap.parse_args(argv)
    deadline = time.monotonic() + args.timeout
    cache = Path(tempfile.mkdtemp(prefix="npuchat-serve-load-"))
    session = ChatSession.open(
        model_path(args.model, args.gguf), name=args.model, cache_dir=cache,
        capacities=[args.capacity], batch_max=args.batch if args.engine == "concurrent" else 1,
    )  # fmt: skip
    total = args.clients * args.requests
    prompts = pick_prompts(session, total)
    card = ServedModel(args.model, session.model.max_capacity, session.draft_name, session.device)
    engine: ChatSession | ConcurrentEngine = session
    if args.engine == "concurrent":  # the engine runs `--batch` replies at once, queues the rest
        engine = ConcurrentEngine(session, max_queue=args.clients)
        app = create_app(engine, card, slots=None)
    else:  # one reply at a time, the server queues the rest
        app = create_app(session, card, max_queue=args.clients)
    with Server(app, "127.0.0.1", 0) as server:
        client = openai.OpenAI(
            base_url=server.url + "/v1", api_key="local", max_retries=0, timeout=args.timeout
        )
        send(client, args.model, -1, 0, "Hello!", 4)  # warm-up, not counted

        alone: list[Result] = []
        t0 = time.perf_counter()
        for key, prompt in enumerate(prompts):
            if time.monotonic() > deadline:
                raise SystemExit("--timeout reached during the one-at-a-time run")
            alone.append(send(client, args.model, key, key % args.clients, prompt, args.max_tokens))
        alone_wall = time.perf_counter() - t0

        def one_client(who: int) -> list[Result]:
            out = []
            for j in range(args.requests):
                if time.monotonic() > deadline:
                    break
                key = who * args.requests + j
                out.append(send(client, args.model, key, who, prompts[key], args.max_tokens))
            return out

        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            together = [r for rs in pool.map(one_client, range(args.clients)) for r in rs]
        together_wall = time.perf_counter() - t0
    engine.close()

    # one-at-a-time results are grouped by the same client split for the per-client figures
    for r in alone:
        r.client = r.key // args.requests
    by_key = {r.key: r for r in alone}
    mixed = [r.key for r in together if not r.error and r.text != by_key[r.key].text]
    missing = total - len(together)
    a = summary(alone, alone_wall, args.clients)
    b = summary(together, together_wall, args.clients)
    print(
        f"npuchat serve load: {args.model}, {args.clients} clients x {args.requests} requests, "
        f"{args.max_tokens} tokens max, greedy, engine {type(engine).__name__} "
        f"({args.batch if args.engine == 'concurrent' else 1} at once, device {session.device})"
    )
    print(f"| figure | one at a time | {args.clients} concurrent | ratio |")
    print("|---|---|---|---|")
    for key, label in (
        ("ttft_p50_s", "TTFT p50 s"),
        ("ttft_p95_s", "TTFT p95 s"),
        ("client_tps_median", "tok/s per client (median)"),
        ("aggregate_tps", "aggregate tok/s"),
        ("wall_s", "wall s"),
    ):
        ratio = b[key] / a[key] if a[key] else float("nan")
        print(f"| {label} | {a[key]:.3f} | {b[key]:.3f} | {ratio:.2f}x |")
    print(
        f"failed: {a['failed']:.0f} alone, {b['failed']:.0f} concurrent; not sent (timeout): "
        f"{missing}; replies differing from the same request alone: {len(mixed)} {mixed[:10]}"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "alone": a,
                    "concurrent": b,
                    "mixed": mixed,
                    "replies": [asdict(r) for r in alone + together],
                },
                indent=1,
            )
        )
    bad = a["failed"] or b["failed"] or mixed or missing
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
