"""A draft model for a target: the rules every front end and benchmark applies the same way.

- Its vocabulary must be the target's, token for token, or its guesses mean nothing.
- Its cache never needs to hold more than the target's largest capacity.
- The target is loaded with a verify graph `VERIFY_K` + 1 rows wide.
- Its per-step costs are measured once at load (`ModelDrafter.calibrate`), so the speculative
  decoder's cost model knows what a draft costs before the first reply.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .devices import QnnOptions
from .drafters import ModelDrafter
from .errors import NpuchatError
from .gguf_reader import GGUFFile
from .model import Model, default_capacities

CALIBRATION_PROBE = tuple(range(16, 32))
VERIFY_K = 8  # the target's widest verify (drafts up to 8 tokens); adaptive k picks what pays


def same_vocabulary(target: Path, draft: Path) -> bool:
    """Whether both GGUFs spell every token id the same way."""
    with GGUFFile(target) as t, GGUFFile(draft) as d:
        return t.config.vocab_size == d.config.vocab_size and t.metadata.get(
            "tokenizer.ggml.tokens"
        ) == d.metadata.get("tokenizer.ggml.tokens")


def load_draft_model(
    path: Path,
    name: str,
    target: Model,
    *,
    cache_dir: Path,
    target_name: str = "the target",
    device: str | None = None,
    threads: int | None = None,
    npu_options: QnnOptions | None = None,
    progress: Callable[[str, float], None] | None = None,
) -> ModelDrafter:
    """Load `path` as a calibrated draft for `target` (on `device`, default the target's)."""
    if not same_vocabulary(target.path, path):
        raise NpuchatError(
            f"--draft {name}: its vocabulary differs from {target_name}'s, so it cannot "
            "draft for it; pick a draft of the same family, or use --draft lookup or --draft none"
        )
    with GGUFFile(path) as g:
        context = min(g.config.context_length, target.max_capacity)
    model = Model.load(
        path,
        cache_dir=cache_dir,
        device=device or target.device,
        threads=threads,
        capacities=default_capacities(context, context),  # as far as the target's cache
        progress=progress,
        npu_options=npu_options,
    )
    drafter = ModelDrafter(model, name)
    drafter.calibrate(list(CALIBRATION_PROBE))
    return drafter
