"""llama.cpp's vocabulary tables (`llama-vocab.cpp`), as data: token types, the pre-tokenizer
regexes per `tokenizer.ggml.pre` family, and the texts it treats as end of generation.

Kept apart from the code that uses them so that following a llama.cpp change means editing a
table here, not the tokenizer.
"""

from __future__ import annotations

from enum import IntEnum


class TokenType(IntEnum):
    """`tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# Token types llama.cpp matches in text before BPE (its cache_special_tokens).
SPECIAL_TYPES = (int(TokenType.CONTROL), int(TokenType.USER_DEFINED), int(TokenType.UNKNOWN))

# --- pre-tokenizer regexes (llm_tokenizer_bpe), by family ----------------------------------------

_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3_RE = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

PRE_REGEXES: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "llama3": (_LLAMA3_RE,),
    "qwen2": (_QWEN2_RE,),
    "starcoder": (r"\p{N}", _GPT2_RE),
    "gpt2": (_GPT2_RE,),
}

# tokenizer.ggml.pre -> (regex family, ignore_merges, default add_bos), as llama_vocab::load maps
# them. Names outside this table are refused rather than tokenized subtly wrong.
PRE_TYPES: dict[str, tuple[str, bool, bool]] = {
    "default": ("default", False, False),
    **{
        name: ("llama3", True, True)
        for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral")
    },
    "dbrx": ("llama3", False, False),
    "smaug-bpe": ("llama3", False, False),
    **{
        name: ("qwen2", False, False)
        for name in ("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez")
    },
    **{
        name: ("starcoder", False, False)
        for name in (
            "smollm",
            "starcoder",
            "refact",
            "command-r",
            "codeshell",
            "exaone",
            "minerva-7b",
        )
    },
    **{
        name: ("gpt2", False, False)
        for name in ("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4", "trillion")
    },
}

# Token texts llama.cpp treats as end-of-generation (llama_vocab::load, special_eog_ids).
EOG_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
        "</s>",
    }
)
