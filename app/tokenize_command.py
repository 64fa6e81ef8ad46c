"""`npuchat tokenize`: token ids as JSON, the way scripts and our own checks compare tokenizers.

The tokenizer is the one a chat session uses, read from the same cache (`tokenizer_cache`): a
SentencePiece vocabulary takes seconds to build and a script may tokenize many texts.
"""

from __future__ import annotations

import json
import sys

from npuchat.engine.gguf_reader import GGUFFile
from npuchat.engine.hashing import model_sha256
from npuchat.engine.tokenizer import Tokenizer, cache_path

from .context import AppContext


def cmd_tokenize(ctx: AppContext, model: str, text: str, special: bool) -> int:
    path = ctx.catalog.resolve(model)
    if text == "-":
        text = sys.stdin.read()
    cache = ctx.paths.cache_dir
    kept = cache_path(cache, model_sha256(path, cache))
    with GGUFFile(path) as g:
        tok = Tokenizer.from_gguf(g, kept)
    print(json.dumps(tok.encode(text, parse_special=special)))
    return 0
