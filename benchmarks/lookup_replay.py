"""Replay a recorded chat race's npuchat replies through the speculative decoder, without a model.

    python benchmarks/chat_race.py --only npuchat --json race.json ...
    python benchmarks/lookup_replay.py race.json --model qwen2.5-coder-0.5b \\
        --t-dec 0.030 --t-row 0.011

Greedy replies are known once recorded, so what a drafter would have had accepted at every
round is known too: a stand-in target answers each decode and verify with the recorded token
(one-hot logits) and charges a fake clock what the real step costs (`--t-dec` a decode step,
`--t-row` each further verify row: on a CPU a verify row costs about a prompt token). The real
`SpeculativeDecoder` (its cost model, its choice of k, its retries) runs against it, so this
prints what the engine's own speculation would do turn by turn: rounds, tokens drafted and
accepted, and the steps' time against plain decoding. It measures drafting policy only; the
step costs are the figures given, not this machine's.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chat_race_script import CONVERSATIONS, ORDER, SYSTEM_PROMPT


class Clock:
    """Seconds the stand-in target's steps would have cost."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ReplayTarget:
    """The sequence interface `SpeculativeDecoder.advance` uses, answering from `truth`: the
    token after position p is truth[p]; each step advances `clock` by its modelled cost."""

    def __init__(
        self, truth: Sequence[int], vocab: int, clock: Clock, t_dec: float, t_row: float, k: int
    ) -> None:
        self.truth, self.vocab, self.clock = list(truth), vocab, clock
        self.t_dec, self.t_row = t_dec, t_row
        self.tokens: list[int] = []
        self.max_capacity = 1 << 20
        self.verify_k = k
        self.rows_run = 0

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def _row(self, pos: int) -> np.ndarray:
        row = np.zeros(self.vocab, np.float32)
        row[self.truth[pos] if pos < len(self.truth) else 0] = 1.0
        return row

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        self.tokens += [int(t) for t in ids]
        return self._row(len(self.tokens) - 1)

    def decode(self, token: int) -> np.ndarray:
        self.clock.now += self.t_dec
        self.rows_run += 1
        return self.prefill([token])

    def verify(self, ids: Sequence[int]) -> np.ndarray:
        self.clock.now += self.t_dec + (len(ids) - 1) * self.t_row
        self.rows_run += len(ids)
        start = len(self.tokens)
        self.tokens += [int(t) for t in ids]
        return np.stack([self._row(start + i) for i in range(len(ids))])

    def rollback(self, n: int) -> None:
        del self.tokens[n:]


def conversation_ids(model: Path, race: dict[str, Any]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, reply ids) of each turn, as the engine saw them."""
    from npuchat.engine.chat_template import ChatTemplate
    from npuchat.engine.events import ChatMessage
    from npuchat.engine.gguf_reader import GGUFFile
    from npuchat.engine.prompts import PromptBuilder
    from npuchat.engine.tokenizer import Tokenizer

    gguf = GGUFFile(model)
    tokenizer = Tokenizer.from_gguf(gguf)
    builder = PromptBuilder(ChatTemplate.from_gguf(gguf), tokenizer, model.stem)
    turns, replies, out = race["npuchat"]["turns"], {}, []
    for (conv, turn), rec in zip(ORDER, turns, strict=True):
        msgs = []
        for t in range(turn):
            msgs += [ChatMessage("user", CONVERSATIONS[conv][t]), replies[(conv, t)]]
        msgs.append(ChatMessage("user", CONVERSATIONS[conv][turn]))
        # an older record without ids: its text again, nearly always the same ids
        ids = rec.get("ids") or tokenizer.encode(rec["reply"])
        out.append((builder.ids(SYSTEM_PROMPT, msgs), list(ids)))
        replies[(conv, turn)] = ChatMessage("assistant", rec["reply"])
    return out


def replay_turn(spec: Any, prompt: list[int], reply: list[int], target: ReplayTarget) -> int:
    """Run the decoder over one recorded reply; returns the reply tokens it produced."""
    from npuchat.engine.events import SamplingParams
    from npuchat.engine.sampler import Sampler

    target.tokens = []
    target.truth = [*prompt[1:], *reply, 0]  # the token after each position (0: the stop)
    sampler = Sampler(SamplingParams(temperature=0.0, max_tokens=len(reply)), prompt)
    pending = sampler.sample(target.prefill(prompt))
    spec.new_reply()
    made = 1
    while made < len(reply):
        _, new = spec.advance(target, pending, sampler, len(reply) - made)
        assert new == reply[made : made + len(new)], "the replay left the recorded reply"
        made += len(new)
        pending = new[-1]
    return made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("race", help="chat_race.py --json output (npuchat side with reply ids)")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--models-dir", default="~/.cache/npuchat-test/models")
    ap.add_argument("--t-dec", type=float, default=0.030, help="a decode step's seconds")
    ap.add_argument("--t-row", type=float, default=0.011, help="a further verify row's seconds")
    ap.add_argument("--k", type=int, default=8, help="the widest verify, less one")
    args = ap.parse_args()
    from npuchat.engine.drafters import LookupDrafter
    from npuchat.engine.speculative import SpeculativeDecoder

    race = json.loads(Path(args.race).read_text())
    model = Path(args.models_dir).expanduser() / f"{args.model}.gguf"
    turns = conversation_ids(model, race)
    vocab = 1 + max(max(p + r) for p, r in turns)
    clock = Clock()
    target = ReplayTarget([], vocab, clock, args.t_dec, args.t_row, args.k)
    spec = SpeculativeDecoder(target, [LookupDrafter()], clock=clock)  # type: ignore[arg-type]
    spec.calibrate(target)  # type: ignore[arg-type]
    total = plain = 0.0
    print("turn   prompt reply  rounds drafted accepted   steps s  plain s")
    for (conv, turn), (prompt, reply) in zip(ORDER, turns, strict=True):
        t0 = clock.now
        replay_turn(spec, prompt, reply, target)
        st, spent, alone = spec.stats, clock.now - t0, (len(reply) - 1) * args.t_dec
        total, plain = total + spent, plain + alone
        print(
            f"c{conv} t{turn} {len(prompt):>7}{len(reply):>6}{st.rounds:>8}{st.drafted:>8}"
            f"{st.accepted:>9}{spent:>10.2f}{alone:>9.2f}"
        )
    print(f"decode steps: {total:.2f} s modelled, plain decoding {plain:.2f} s")


if __name__ == "__main__":
    main()
