"""Speculation on real models (`realmodel`): verify rows equal decode logits bit for bit on
real quantized files, and the qwen2.5-coder 1.5b / 0.5b pair plus lookup gives the target's
own greedy tokens; the same properties on synthetic models are `test_speculative.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import real_models
from speculative_steps import complete_ids, decode_and_verify

from npuchat.engine.drafters import LookupDrafter, ModelDrafter
from npuchat.engine.events import SamplingParams
from npuchat.engine.model import Model
from npuchat.engine.session import ChatSession, SessionOptions
from npuchat.engine.speculative import SpeculativeDecoder


@pytest.mark.realmodel
@pytest.mark.parametrize(
    ("name", "kv_dtype"),
    [
        ("smollm2-135m", "f32"),
        ("smollm2-135m", "f16"),
        ("qwen2.5-coder-0.5b", "f32"),
        ("gemma3-270m", "f32"),
    ],
)
def test_real_model_verify_rows_equal_decode_bit_for_bit(
    name: str, kv_dtype: str, real_gguf: Callable[[str], Path]
) -> None:
    """The same on real files (Q4_1; Q5_0/Q8_0/Q4_K/Q6_K), where a one-row and a multi-row
    kernel would differ by 0.2–0.9 in the logits (measured before decode steps were padded);
    Gemma 3 (Q5_0/Q4_K/Q6_K/Q8_0) with its sliding and global layers. SmolLM2's and Gemma 3's
    decode steps attend by the few-rows path (3 or 4 query heads a KV head), their verify steps
    by the eight-rows one; SmolLM2 also over an f16 cache."""
    graphs = real_models.cache_root() / "graphs"
    with Model.load(
        real_gguf(name), cache_dir=graphs, threads=2, verify_k=7, kv_dtype=kv_dtype
    ) as m:
        prompt = [int(t) for t in np.random.default_rng(2).integers(100, 5000, 250)]
        pairs = decode_and_verify(m, prompt, [2000, 2001, 345, 2003, 17, 999, 4242, 3])
    for ref, row in pairs:
        assert np.array_equal(row, ref)


@pytest.mark.realmodel
def test_real_pair_greedy_equals_target_only(
    real_gguf: Callable[[str], Path],
) -> None:
    """qwen2.5-coder-1.5b with its 0.5b draft plus lookup: the same tokens as target-only,
    with the int8-activation graphs the app runs, on code writing, code editing and chat."""
    graphs = real_models.cache_root() / "graphs"
    kw = {"cache_dir": graphs, "threads": 2, "capacities": [256]}
    session = ChatSession.open(
        real_gguf("qwen2.5-coder-1.5b"),
        name="qwen2.5-coder-1.5b",
        options=SessionOptions(persist_prefixes=False),
        verify_k=4,
        **kw,  # type: ignore[arg-type]
    )
    draft = Model.load(real_gguf("qwen2.5-coder-0.5b"), **kw)  # type: ignore[arg-type]
    prompts = [
        "def fibonacci(n):\n    '''Return the n-th Fibonacci number.'''\n",
        "Rename x to count:\n```python\nx = 0\nfor item in items:\n    x += 1\n```\n",
        "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    try:
        for text in prompts:
            ids = session.tokenizer.encode(text, parse_special=True)
            session.speculative = None
            plain = complete_ids(session, ids, params)
            session.speculative = SpeculativeDecoder(
                session.model, [LookupDrafter(), ModelDrafter(draft, "draft")], fixed_k=3
            )
            assert complete_ids(session, ids, params) == plain
            assert session.speculative.stats.accepted > 0
    finally:
        session.speculative = None
        session.close()
        draft.close()
