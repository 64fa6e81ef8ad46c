"""A scripted engine that tokenizes for real: `npuchat serve`'s /tokenize and /detokenize over a
model's own tokenizer and chat template, without loading its weights."""

from __future__ import annotations

from pathlib import Path

from scripted_engine import ScriptedEngine

from npuchat.engine.chat_template import ChatTemplate
from npuchat.engine.gguf_reader import GGUFFile
from npuchat.engine.prompts import PromptBuilder
from npuchat.engine.token_view import TokenView
from npuchat.engine.tokenizer import Tokenizer

__all__ = ["ViewingEngine", "viewing"]


class ViewingEngine(TokenView, ScriptedEngine):
    """Scripted replies, and the real `TokenView` (what the concurrent engine delegates to)."""

    def __init__(self, prompts: PromptBuilder, name: str) -> None:
        TokenView.__init__(self, prompts)
        ScriptedEngine.__init__(self, model_name=name)


def viewing(gguf: Path, name: str) -> ViewingEngine:
    with GGUFFile(gguf) as g:
        tok, template = Tokenizer.from_gguf(g), ChatTemplate.from_gguf(g)
    return ViewingEngine(PromptBuilder(template, tok, name), name)
