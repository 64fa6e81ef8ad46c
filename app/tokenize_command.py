"""`npuchat tokenize`: token ids as JSON, the way scripts and our own checks compare tokenizers."""

from __future__ import annotations

import json
import sys

from npuchat.engine.gguf_reader import GGUFFile
from npuchat.engine.tokenizer import Tokenizer

from .context import AppContext


def cmd_tokenize(ctx: AppContext, model: str, text: str, special: bool) -> int:
    path = ctx.catalog.resolve(model)
    if text == "-":
        text = sys.stdin.read()
    with GGUFFile(path) as g:
        tok = Tokenizer.from_gguf(g)
    print(json.dumps(tok.encode(text, parse_special=special)))
    return 0
