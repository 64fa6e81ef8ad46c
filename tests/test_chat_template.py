"""Chat template tests: the real GGUFs' own templates against llama.cpp's rendered prompts, the
Phi-3 format, fallbacks with a warning, and the sandbox."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from real_models import REFERENCE_DIR
from synthetic_vocab import PHI3_CHAT_TEMPLATE

from npuchat.engine.chat_template import ChatTemplate
from npuchat.engine.events import ChatMessage
from npuchat.engine.gguf_reader import GGUFFile
from npuchat.engine.prompts import PromptBuilder, folded_system
from npuchat.engine.tokenizer import Tokenizer

REAL_MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b")  # ChatML, compared with llama.cpp
QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def real_model(real_gguf: Callable[[str], Path]) -> Callable[[str], tuple[ChatTemplate, Tokenizer]]:
    built: dict[str, tuple[ChatTemplate, Tokenizer]] = {}

    def get(name: str) -> tuple[ChatTemplate, Tokenizer]:
        if name not in built:
            with GGUFFile(real_gguf(name)) as g:
                built[name] = (ChatTemplate.from_gguf(g), Tokenizer.from_gguf(g))
        return built[name]

    return get


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def system(text: str) -> dict[str, str]:
    return {"role": "system", "content": text}


@pytest.mark.realmodel
@pytest.mark.parametrize("name", REAL_MODELS)
def test_prompts_match_llama_cpp(
    name: str, real_model: Callable[[str], tuple[ChatTemplate, Tokenizer]]
) -> None:
    """Every greedy reference case: same prompt text, same prompt ids as llama-server used."""
    template, tok = real_model(name)
    cases = json.loads((REFERENCE_DIR / f"greedy-{name}.json").read_text())["cases"]
    assert cases
    for case in cases:
        question = re.search(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", case["prompt"], re.S)
        assert question is not None
        prompt = template.render([user(question.group(1))])
        assert template.warning is None
        assert prompt == case["prompt"]
        assert tok.encode_prompt(prompt) == case["prompt_ids"]


@pytest.mark.realmodel
@pytest.mark.parametrize(
    ("name", "default_system"),
    [("smollm2-135m", SMOL_SYSTEM), ("qwen2.5-coder-0.5b", QWEN_SYSTEM)],
)
def test_chatml_multi_turn(
    name: str,
    default_system: str,
    real_model: Callable[[str], tuple[ChatTemplate, Tokenizer]],
) -> None:
    template, tok = real_model(name)
    assert template.end_marker == "<|im_end|>"
    assert tok.token_to_id("<|im_end|>") in tok.eot_ids
    turns = [user("A?"), assistant("B."), user("C?")]
    expected = (
        "<|im_start|>user\nA?<|im_end|>\n"
        "<|im_start|>assistant\nB.<|im_end|>\n"
        "<|im_start|>user\nC?<|im_end|>\n"
    )
    # No system message: the template's default one comes first.
    assert template.render(turns) == (
        f"<|im_start|>system\n{default_system}<|im_end|>\n{expected}<|im_start|>assistant\n"
    )
    # An explicit system message replaces it; no generation prompt when not asked for.
    assert template.render([system("Be brief."), *turns], add_generation_prompt=False) == (
        f"<|im_start|>system\nBe brief.<|im_end|>\n{expected}"
    )
    assert template.warning is None


# A template in the shape of Phi-3-mini-4k-instruct's: BOS as text, the assistant header written
# after every user turn.
PHI3_MINI_STYLE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') %}"
    "{{'<|user|>' + '\\n' + message['content'] + '<|end|>' + '\\n' + '<|assistant|>' + '\\n'}}"
    "{% elif (message['role'] == 'assistant') %}{{message['content'] + '<|end|>' + '\\n'}}"
    "{% endif %}{% endfor %}"
)


def test_phi3_format() -> None:
    template = ChatTemplate(PHI3_MINI_STYLE, arch="phi3", bos_token="<s>", eos_token="<|end|>")
    turns = [user("Hi"), assistant("Hello!"), user("Bye")]
    assert template.render(turns) == (
        "<s><|user|>\nHi<|end|>\n<|assistant|>\nHello!<|end|>\n<|user|>\nBye<|end|>\n<|assistant|>\n"
    )
    assert template.end_marker == "<|end|>"
    assert template.warning is None


def test_phi3_synthetic_gguf_prompt_ids(synthetic_gguf: Callable[..., Path]) -> None:
    with GGUFFile(synthetic_gguf("phi3")) as g:
        template = ChatTemplate.from_gguf(g)
        tok = Tokenizer.from_gguf(g)
    assert template.source == PHI3_CHAT_TEMPLATE
    prompt = template.render([system("S"), user("Hi")])
    assert prompt == "<|system|>\nS<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"
    ids = tok.encode_prompt(prompt)
    assert ids[0] == tok.bos_id  # the model wants BOS and the template does not write it
    order = ["<|system|>", "<|end|>", "<|user|>", "<|end|>", "<|assistant|>"]
    special_ids = {tok.token_to_id(t) for t in order}
    assert [i for i in ids if i in special_ids] == [tok.token_to_id(t) for t in order]
    assert template.end_marker == "<|end|>"
    assert tok.token_to_id("<|end|>") in tok.eot_ids
    # A template that writes the BOS text itself gets no second BOS.
    with_bos = ChatTemplate(PHI3_MINI_STYLE, arch="phi3", bos_token=tok.token_text(tok.bos_id))
    ids = tok.encode_prompt(with_bos.render([user("Hi")]))
    assert ids.count(tok.bos_id) == 1 and ids[0] == tok.bos_id


@pytest.mark.parametrize(
    ("arch", "expected", "marker"),
    [
        (
            "qwen2",
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
            "<|im_end|>",
        ),
        (
            "llama",
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
            "<|im_end|>",
        ),
        ("phi3", "<|system|>\nS<|end|>\n<|user|>\nHi<|end|>\n", "<|end|>"),
    ],
)
def test_missing_template_falls_back_per_arch(arch: str, expected: str, marker: str) -> None:
    template = ChatTemplate.from_metadata({"general.architecture": arch})
    assert template.warning is not None and "no chat template" in template.warning
    header = "<|assistant|>\n" if arch == "phi3" else "<|im_start|>assistant\n"
    assert template.render([system("S"), user("Hi")]) == expected + header
    assert template.render([system("S"), user("Hi")], add_generation_prompt=False) == expected
    assert template.end_marker == marker
    assert template.warning is not None


@pytest.mark.parametrize(
    ("source", "warning_part"),
    [
        ("{% for m in messages %}{{ m.content }", "does not parse"),
        ("{{ raise_exception('Conversation roles must alternate') }}", "roles must alternate"),
        ("{{ messages[5]['content'] + 1 }}", "failed"),
    ],
)
def test_broken_template_falls_back_with_a_warning(source: str, warning_part: str) -> None:
    template = ChatTemplate(source, arch="qwen2")
    prompt = template.render([user("Hi")])
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert template.warning is not None
    assert warning_part in template.warning and "ChatML" in template.warning
    assert "\n" not in template.warning


def test_warning_clears_when_the_template_renders_again() -> None:
    source = "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}ok"
    template = ChatTemplate(source, arch="qwen2")
    assert template.render([user("a"), user("b")]).startswith("<|im_start|>user")
    assert template.warning is not None
    assert template.render([user("a")]) == "ok"
    assert template.warning is None


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os.getcwd() }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{% set _ = messages.append({'role': 'user', 'content': 'injected'}) %}x",
        "{% set _ = messages[0].update({'content': 'changed'}) %}x",
    ],
)
def test_sandbox_blocks_python_internals(source: str) -> None:
    messages = [user("Hi")]
    template = ChatTemplate(source, arch="qwen2")
    prompt = template.render(messages)
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert template.warning is not None and "failed" in template.warning
    assert messages == [user("Hi")]


def test_hugging_face_conventions() -> None:
    # tojson is json.dumps (no HTML escaping, non-ASCII kept); trim/lstrip_blocks as in HF.
    source = (
        "{% for m in messages %}\n"
        "    {{ m | tojson }}\n"
        "{% endfor %}"
        "{% for i in range(3) %}{% if i == 1 %}{% break %}{% endif %}[{{ i }}]{% endfor %}"
        "{{ bos_token }}|{{ eos_token }}"
        "{% generation %}<g>{% endgeneration %}"
    )
    template = ChatTemplate(source, arch="llama", bos_token="<s>", eos_token="</s>")
    prompt = template.render([user("<b>é</b>")])
    assert prompt == '    {"role": "user", "content": "<b>é</b>"}\n[0]<s>|</s><g>'
    assert template.warning is None


def test_messages_may_be_any_mapping() -> None:
    class Turn(dict[str, Any]):
        pass

    template = ChatTemplate("{{ messages[0].role }}:{{ messages[0]['content'] }}", arch="qwen2")
    assert template.render([Turn(role="user", content="x")]) == "user:x"


# Gemma 3's template (its text-only part): the system prompt joins the first user turn and
# any other order of roles than user, model, user... is refused
GEMMA3_STYLE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


@pytest.mark.realmodel
@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (  # Qwen2.5's own template renders a system turn where it comes
            None,
            "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>system\nNote: be brief"
            "<|im_end|>\n<|im_start|>assistant\n",
        ),
        (  # Gemma 3's takes only alternating turns: the note joins the question
            GEMMA3_STYLE,
            "<start_of_turn>user\nYou help.\n\nWhat is 2+2?\n\nNote: be brief<end_of_turn>\n"
            "<start_of_turn>model\n",
        ),
    ],
)
def test_a_system_message_among_the_turns(
    source: str | None,
    expected: str,
    real_model: Callable[[str], tuple[ChatTemplate, Tokenizer]],
) -> None:
    """A system message after the conversation began (Claude Code's environment note) is
    rendered by the templates that take one, and folded into the user turn by those that
    refuse it, instead of failing over to a fallback format."""
    qwen, tok = real_model("qwen2.5-coder-0.5b")
    template = qwen if source is None else ChatTemplate(source, arch="gemma3")
    builder = PromptBuilder(template, tok, "m")
    messages = [ChatMessage("user", "What is 2+2?"), ChatMessage("system", "Note: be brief")]
    text = tok.decode(builder.ids("You help.", messages), special=True)
    assert template.warning is None
    assert text.endswith(expected)


def test_system_messages_fold_into_the_user_turns_around_them() -> None:
    turns = [
        ChatMessage("system", "a"),
        ChatMessage("user", "q1"),
        ChatMessage("assistant", "r1"),
        ChatMessage("system", "b"),
        ChatMessage("user", "q2"),
        ChatMessage("assistant", "r2"),
        ChatMessage("system", "c"),
    ]
    assert folded_system(turns) == [
        ChatMessage("user", "a\n\nq1"),
        ChatMessage("assistant", "r1"),
        ChatMessage("user", "b\n\nq2\n\nc"),
        ChatMessage("assistant", "r2"),
    ]
    lone = [ChatMessage("assistant", "r"), ChatMessage("system", "s")]
    assert folded_system(lone) == lone
