"""The synthetic models' vocabularies: tokenizers trained on a fixed text, in each family's layout.

A byte-level BPE (GPT-2 style) for Llama/SmolLM2 and Qwen, and SentencePiece-style vocabularies
for Phi-3 and Gemma, trained deterministically on `CORPUS` with `tokenizers`, plus each family's
chat specials and template. Gemma's layout puts pad, eos, bos, unk first, has its turn markers
as control tokens and no space prefix; Phi-3's (Llama's) puts unk, <s>, </s> first and its chat
specials last. Both are written by one function (`_add_spm`): they differ only in their
specials, ids and space prefix.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

from gguf import GGUFWriter, TokenType
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

__all__ = [
    "CORPUS",
    "GEMMA_CHAT_TEMPLATE",
    "PHI3_CHAT_TEMPLATE",
    "QWEN25_TOOL_TEMPLATE",
    "add_bpe_vocab",
    "add_spm_vocab",
]

# Fixed training text: English prose and Python, so the merges look like a real model's.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model can still say hello to the world.
Hello world! How are you today? I am fine, thank you. What is the capital of France? Paris.
The weather is nice and the sun is shining. We went to the market to buy apples and bread.
Language models read tokens, one after another, and predict the next token in the sequence.
A neural network learns weights from data; the attention layer looks back at earlier tokens.
Please write a function that returns the sum of two numbers, and explain how it works.
Sure! Here is a short answer with a code example in Python, followed by a test.
This is a test of the tokenizer. It should handle numbers like 42, 3.14 and 2024 as well.
Contractions such as don't, can't, it's, we'll and they've appear in everyday English text.

def add(a, b):
    \"\"\"Return the sum of a and b.\"\"\"
    return a + b


class Counter:
    def __init__(self, start=0):
        self.value = start

    def increment(self, step=1):
        self.value += step
        return self.value


for i in range(10):
    if i % 2 == 0:
        print(f"even: {i}")
    else:
        print("odd:", i)

import numpy as np
x = np.zeros((3, 4), dtype=np.float32)
result = [word.lower() for word in text.split() if word]
with open("data.txt") as f:
    lines = f.readlines()
"""

_CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_PHI3_SPECIALS = ("<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>")


def _chatml_template(default_system: str) -> str:
    """A ChatML template in the shape SmolLM2's and Qwen2.5's GGUFs carry."""
    return (
        "{% for message in messages %}"
        "{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\\n" + default_system + "<|im_end|>\\n' }}"
        "{% endif %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )


PHI3_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<|system|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<|assistant|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)

# Qwen2.5's chat template, copied from the qwen2.5-coder-0.5b GGUF (`tokenizer.chat_template`):
# tools go into the system block, calls come back as <tool_call>{json}</tool_call>.
QWEN25_TOOL_TEMPLATE = (Path(__file__).parent / "templates" / "qwen2.5.jinja").read_text()

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


@lru_cache(maxsize=4)
def _train_bpe(vocab_size: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Byte-level BPE tokens (GPT-2 byte-to-unicode form, by id) and merges ("a b")."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    tokens = tuple(sorted(vocab, key=vocab.__getitem__))
    merges = tuple(m if isinstance(m, str) else " ".join(m) for m in model["merges"])
    return tokens, merges


@lru_cache(maxsize=4)
def _train_spm(vocab_size: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """SentencePiece-style pieces: merged pieces in merge order, then the single characters."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [m.split(" ") if isinstance(m, str) else m for m in model["merges"]]
    merged = tuple(a + b for a, b in merges)
    merged_set = set(merged)
    vocab: dict[str, int] = model["vocab"]
    singles = tuple(t for t in sorted(vocab, key=vocab.__getitem__) if t not in merged_set)
    return merged, singles


def add_bpe_vocab(w: GGUFWriter, arch: str, template: str | None = None) -> int:
    tokens, merges = _train_bpe(400)
    normal = list(tokens)
    specials = list(_CHATML_SPECIALS)
    # SmolLM2 puts its specials first, Qwen2.5 last; keep both layouts covered.
    all_tokens = specials + normal if arch == "llama" else normal + specials
    types = [TokenType.CONTROL if t in _CHATML_SPECIALS else TokenType.NORMAL for t in all_tokens]
    ids = {t: i for i, t in enumerate(all_tokens)}
    pre = {"llama": "smollm", "qwen2": "qwen2", "qwen3": "qwen2"}.get(arch, "llama-bpe")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(all_tokens)
    w.add_token_types([int(t) for t in types])
    w.add_token_merges(list(merges))
    if arch == "llama":
        w.add_bos_token_id(ids["<|im_start|>"])
        w.add_unk_token_id(ids["<|endoftext|>"])
    else:
        w.add_bos_token_id(ids["<|endoftext|>"])
    w.add_eos_token_id(ids["<|im_end|>"])
    qwen = arch in ("qwen2", "qwen3")
    w.add_pad_token_id(ids["<|endoftext|>"] if qwen else ids["<|im_end|>"])
    w.add_add_bos_token(False)
    w.add_add_space_prefix(False)
    system = "You are a tiny synthetic test model." if qwen else "You are SynthLM."
    w.add_chat_template(template or _chatml_template(system))
    return len(all_tokens)


def add_spm_vocab(w: GGUFWriter, family: str = "phi3") -> int:
    """A SentencePiece vocabulary in Phi-3's layout, or Gemma's (`family="gemma"`)."""
    merged, singles = _train_spm(300)
    if family == "gemma":
        head = [(t, TokenType.CONTROL) for t in _GEMMA_SPECIALS]
        head[3] = ("<unk>", TokenType.UNKNOWN)
        return _add_spm(
            w,
            head,
            merged,
            singles,
            (),
            ids=("<bos>", "<eos>", None, "<unk>", "<pad>"),
            space_prefix=False,
            template=GEMMA_CHAT_TEMPLATE,
        )
    head = [("<unk>", TokenType.UNKNOWN), ("<s>", TokenType.CONTROL), ("</s>", TokenType.CONTROL)]
    return _add_spm(
        w,
        head,
        merged,
        singles,
        _PHI3_SPECIALS,
        ids=("<s>", "<|endoftext|>", "<|end|>", "<unk>", "<|endoftext|>"),
        space_prefix=True,
        template=PHI3_CHAT_TEMPLATE,
    )


def _add_spm(
    w: GGUFWriter,
    head: Sequence[tuple[str, TokenType]],
    merged: Sequence[str],
    singles: Sequence[str],
    tail: Sequence[str],
    *,
    ids: tuple[str, str, str | None, str, str],
    space_prefix: bool,
    template: str,
) -> int:
    """Write a SentencePiece vocabulary: `head` specials, the 256 byte tokens, the pieces (scored
    -rank like Llama's tokenizer.model: merged pieces first, characters last), `tail` control
    specials. `ids` names the bos, eos, eot (None: none), unk and pad tokens. Returns its size."""
    tokens = [t for t, _ in head]
    types = [kind for _, kind in head]
    scores = [0.0] * len(tokens)
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(TokenType.BYTE)
        scores.append(0.0)
    for rank, piece in enumerate((*merged, *singles)):
        tokens.append(piece)
        types.append(TokenType.NORMAL)
        scores.append(-float(rank))
    for special in tail:
        tokens.append(special)
        types.append(TokenType.CONTROL)
        scores.append(0.0)
    index = {t: i for i, t in enumerate(tokens)}
    bos, eos, eot, unk, pad = ids
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types([int(t) for t in types])
    w.add_bos_token_id(index[bos])
    w.add_eos_token_id(index[eos])
    if eot is not None:
        w.add_eot_token_id(index[eot])
    w.add_unk_token_id(index[unk])
    w.add_pad_token_id(index[pad])
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(space_prefix)
    w.add_chat_template(template)
    return len(tokens)
