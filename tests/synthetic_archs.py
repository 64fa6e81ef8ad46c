"""The parts of the synthetic GGUFs that belong to the newer architectures (used by synthetic.py).

Gemma 3's vocabulary is a SentencePiece one in Gemma's layout (pad, eos, bos, unk first, turn
markers as control tokens, no space prefix, BOS added), with a Gemma-style chat template; its
sliding layers are written with llama.cpp's keys. Llama 3's per-frequency rope factors follow
Meta's llama3 scaling rule (factor 8, low/high frequency factors 1 and 4, original context 8192),
the rule llama.cpp's converter uses to write `rope_freqs.weight`, with the original context
scaled down to 32 positions so that the factors change the logits within a test's few tokens.
"""

from __future__ import annotations

import numpy as np
from gguf import GGUFWriter, TokenType

__all__ = [
    "GEMMA_CHAT_TEMPLATE",
    "WIDE_HEAD_ARCHS",
    "add_gemma_vocab",
    "add_window_metadata",
    "llama3_freq_factors",
]

WIDE_HEAD_ARCHS = frozenset({"qwen3", "gemma3"})  # head_dim > d_model / n_heads, like the real ones

_GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")

# The shape of Gemma 3 instruct GGUFs' template: no system role (it opens the first user turn).
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\\n\\n' %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


def add_gemma_vocab(w: GGUFWriter, merged: tuple[str, ...], singles: tuple[str, ...]) -> int:
    """Write a Gemma-layout SentencePiece vocabulary; returns its size."""
    tokens = list(_GEMMA_SPECIALS)
    types = [TokenType.CONTROL] * 3 + [TokenType.UNKNOWN] + [TokenType.CONTROL] * 2
    scores = [0.0] * len(tokens)
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(TokenType.BYTE)
        scores.append(0.0)
    for rank, piece in enumerate((*merged, *singles)):
        tokens.append(piece)
        types.append(TokenType.NORMAL)
        scores.append(-float(rank))
    ids = {t: i for i, t in enumerate(tokens)}
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types([int(t) for t in types])
    w.add_bos_token_id(ids["<bos>"])
    w.add_eos_token_id(ids["<eos>"])
    w.add_unk_token_id(ids["<unk>"])
    w.add_pad_token_id(ids["<pad>"])
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    w.add_chat_template(GEMMA_CHAT_TEMPLATE)
    return len(tokens)


def add_window_metadata(w: GGUFWriter, arch: str, window: int | None, pattern: int | None) -> None:
    """Sliding-window keys: Gemma 3 slides by default (window 8, every other layer)."""
    if arch == "gemma3":
        w.add_sliding_window(8 if window is None else window)
        w.add_uint32("gemma3.attention.sliding_window_pattern", 2 if pattern is None else pattern)
    elif window:
        w.add_sliding_window(window)


def llama3_freq_factors(head_dim: int, theta: float = 100000.0, old_ctx: int = 32) -> np.ndarray:
    """`rope_freqs.weight` by Meta's llama3 rule (as convert_hf_to_gguf computes it)."""
    factor, low, high = 8.0, 1.0, 4.0
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    out = np.where(wavelen < old_ctx / high, 1.0, factor)
    mid = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    out = np.where(mid, 1.0 / ((1 - smooth) / factor + smooth), out)
    return out.astype(np.float32)
