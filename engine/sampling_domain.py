"""The values each sampling parameter may take, checked once for every front end.

Why here and not in each front end: the CLI, the app's settings dialog and the HTTP service must
refuse the same values with the same words, and the engine must never run with a value outside
its domain (a NaN temperature or a zero repetition penalty turns every probability into NaN and
the reply into silence). `sampling_problems` lists what is wrong, `check_sampling` raises it as
one line; the session answers a request that fails the check with `Failed(kind="invalid")`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import NpuchatError
from .events import SamplingParams
from .logprobs import MAX_TOP_LOGPROBS

MAX_SEED = 2**64 - 1


@dataclass(frozen=True)
class Domain:
    """An inclusive range; `above_low` makes the low end exclusive."""

    low: float
    high: float
    whole: bool = False
    above_low: bool = False

    def describe(self) -> str:
        kind = "a whole number" if self.whole else "a number"
        low = "above" if self.above_low else "from"
        return f"{kind} {low} {self.low:g} to {self.high:g}"

    def holds(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if self.whole and not isinstance(value, int):
            return False
        if not math.isfinite(value):
            return False
        if self.above_low:
            return self.low < value <= self.high
        return self.low <= value <= self.high


DOMAINS: dict[str, Domain] = {
    "temperature": Domain(0.0, 5.0),
    "top_k": Domain(0, 1_000_000, whole=True),
    "top_p": Domain(0.0, 1.0, above_low=True),
    "min_p": Domain(0.0, 1.0),
    "repeat_penalty": Domain(0.0, 10.0, above_low=True),
    "presence_penalty": Domain(-2.0, 2.0),  # OpenAI's range
    "frequency_penalty": Domain(-2.0, 2.0),
    "max_tokens": Domain(1, 1_000_000, whole=True),
}
"""temperature 0 = greedy; top_k 0 = off; top_p 1 = off; min_p 0 = off; repeat_penalty 1 = off;
presence_penalty and frequency_penalty 0 = off."""


SAMPLING_FIELDS = (*DOMAINS, "logprobs", "seed", "stop")


MAX_LOGIT_BIAS = 1024  # tokens one request may bias
BIAS = Domain(-100.0, 100.0)  # OpenAI's


def sampling_problems(params: SamplingParams, vocab: int | None = None) -> list[tuple[str, str]]:
    """(field, what is allowed) for every field of `params` outside its domain; `vocab`: the
    model's vocabulary size, which the logit bias's token ids must be below."""
    problems = [
        (name, f"must be {domain.describe()}, got {getattr(params, name)!r}")
        for name, domain in DOMAINS.items()
        if not domain.holds(getattr(params, name))
    ]
    seed = params.seed
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED
    ):
        problems.append(("seed", f"must be a whole number from 0 to 2**64-1, got {seed!r}"))
    want = params.logprobs
    if want is not None and (
        isinstance(want, bool) or not isinstance(want, int) or not 0 <= want <= MAX_TOP_LOGPROBS
    ):
        problems.append(
            ("logprobs", f"must be a whole number from 0 to {MAX_TOP_LOGPROBS}, got {want!r}")
        )
    problems.extend(_bias_problems(params.logit_bias, vocab))
    if not isinstance(params.stop, tuple) or not all(isinstance(s, str) and s for s in params.stop):
        problems.append(("stop", "must be non-empty strings"))
    return problems


def _bias_problems(bias: object, vocab: int | None) -> list[tuple[str, str]]:
    if not isinstance(bias, tuple) or len(bias) > MAX_LOGIT_BIAS:
        return [("logit_bias", f"must hold at most {MAX_LOGIT_BIAS} (token id, bias) pairs")]
    top = f" below {vocab}" if vocab is not None else ""
    end = vocab if vocab is not None else 2**63
    for pair in bias:
        ok = isinstance(pair, tuple) and len(pair) == 2
        token, value = pair if ok else (None, None)
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < end:
            return [("logit_bias", f"token ids must be whole numbers from 0{top}, got {token!r}")]
        if not BIAS.holds(value):
            return [("logit_bias", f"biases must be {BIAS.describe()}, got {value!r}")]
    return []


def check_sampling(params: SamplingParams, names: Mapping[str, str] | None = None) -> None:
    """Raise one NpuchatError naming every bad field (as `names` spells them, e.g. CLI flags)."""
    problems = sampling_problems(params)
    if problems:
        spelled = names or {}
        raise NpuchatError("; ".join(f"{spelled.get(name, name)} {why}" for name, why in problems))
