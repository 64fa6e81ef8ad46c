"""`npuchat run` end to end on an imported synthetic model: streaming text, JSON lines,
raw prompts, saved conversations and errors."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from npuchat.app.cli import main
from npuchat.engine.gguf_reader import GGUFFile
from npuchat.engine.tokenizer import Tokenizer


def _json_lines(out: str) -> tuple[list[dict], dict]:
    rows = [json.loads(line) for line in out.splitlines() if line.strip()]
    return rows[:-1], rows[-1]


def test_json_lines_tokens_then_metrics(syn: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["run", "--model", "syn", "-p", "hello world", "-n", "7", "--json", "-t", "0"])
    assert rc == 0
    tokens, last = _json_lines(capsys.readouterr().out)
    m = last["metrics"]
    for key in ("ttft_s", "prefill_tokens", "prefill_tps", "decode_tokens", "decode_tps"):
        assert m[key] > 0, key
    assert m["kv_used"] == m["prefill_tokens"] + len(tokens) - 1
    assert m["kv_capacity"] >= m["kv_used"]
    assert last["stop"] in ("max_tokens", "eos")
    with GGUFFile(syn) as g:
        tok = Tokenizer.from_gguf(g)
    text = "".join(t["text"] for t in tokens)
    ids = [t["id"] for t in tokens]
    stop_ids = set(tok.eot_ids)
    assert tok.decode([i for i in ids if i not in stop_ids]) == text


def test_plain_output_matches_json_text(syn: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["run", "--model", "syn", "-p", "the fox", "-n", "6", "-t", "0"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--json"]) == 0
    tokens, _ = _json_lines(capsys.readouterr().out)
    assert plain.rstrip("\n") == "".join(t["text"] for t in tokens).rstrip("\n")


def test_prompt_as_words_after_run(syn: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`npuchat run the fox` is `npuchat run -p "the fox"` (options before or after the words)."""
    flags = ["-n", "6", "-t", "0", "--json", "--draft", "none"]
    runs = {}
    for name, args in {
        "given": ["-p", "the fox", *flags],
        "words": [*flags, "the", "fox"],
        "one word": ["the", *flags],
    }.items():
        assert main(["run", "--model", "syn", *args]) == 0
        tokens, last = _json_lines(capsys.readouterr().out)
        m = last["metrics"]  # a later run reuses the earlier ones' cached prefix
        runs[name] = ([t["id"] for t in tokens], m["prefill_tokens"] + m["reused_tokens"])
    assert runs["words"] == runs["given"] and runs["words"][0]
    assert runs["one word"][1] < runs["words"][1]  # the second word was not dropped


def test_presence_and_frequency_penalties_reach_the_sampler(
    syn: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Greedy, a reply that repeats a token changes under a frequency penalty; none given, the
    run equals one with both at 0."""
    base = ["run", "--model", "syn", "-p", "the fox", "-n", "24", "-t", "0", "--json"]
    replies = {}
    for name, extra in {
        "none": [],
        "zero": ["--presence-penalty", "0", "--frequency-penalty", "0"],
        "penalised": ["--presence-penalty", "2", "--frequency-penalty", "2"],
    }.items():
        assert main([*base, "--draft", "none", *extra]) == 0
        tokens, _ = _json_lines(capsys.readouterr().out)
        replies[name] = [t["id"] for t in tokens]
    assert replies["none"] == replies["zero"]
    assert len(set(replies["none"])) < len(replies["none"])  # the synthetic model repeats
    assert replies["penalised"] != replies["none"]


def test_logprobs_in_json_lines(syn: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Greedy: each token's line carries its log probability, the likeliest of its two
    alternatives (the first of them is the token itself), and the same tokens as without."""
    base = ["run", "--model", "syn", "-p", "the fox", "-n", "6", "-t", "0", "--json"]
    assert main(base) == 0
    plain, _ = _json_lines(capsys.readouterr().out)
    assert main([*base, "--logprobs", "2"]) == 0
    tokens, _ = _json_lines(capsys.readouterr().out)
    assert [t["id"] for t in tokens] == [t["id"] for t in plain]
    for t in tokens:
        assert t["logprob"] <= 0 and t["top"][0]["id"] == t["id"]
        assert t["logprob"] == t["top"][0]["logprob"] >= t["top"][1]["logprob"]


def test_format_json_keeps_the_reply_a_json_object(
    syn: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The synthetic model writes noise; with --format json its reply starts an object."""
    base = ["run", "--model", "syn", "-p", "the fox", "-n", "20", "-t", "0", "--json"]
    assert main(base) == 0
    plain, _ = _json_lines(capsys.readouterr().out)
    assert main([*base, "--format", "json"]) == 0
    tokens, _ = _json_lines(capsys.readouterr().out)
    assert "".join(t["text"] for t in tokens).startswith("{")
    assert not "".join(t["text"] for t in plain).startswith("{")


class _Terminal(io.TextIOWrapper):
    """Standard input that says it is a terminal, holding what the user typed before Ctrl-D."""

    def isatty(self) -> bool:
        return True


def test_a_prompt_typed_at_a_terminal_is_asked_for(
    syn: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no prompt and a terminal for standard input, the run says how to end the prompt
    before it waits (else it looks hung), then answers what was typed."""
    monkeypatch.setattr(sys, "stdin", _Terminal(io.BytesIO(b"the fox\n")))
    assert main(["run", "--model", "syn", "-n", "6", "-t", "0", "--json"]) == 0
    out = capsys.readouterr()
    assert "Ctrl-D" in out.err
    tokens, _ = _json_lines(out.out)
    assert main(["run", "--model", "syn", "-n", "6", "-t", "0", "--json", "-p", "the fox\n"]) == 0
    given, _ = _json_lines(capsys.readouterr().out)
    assert [t["id"] for t in tokens] == [t["id"] for t in given]


def test_raw_prompt_skips_the_template(syn: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--model", "syn", "-p", "hello world", "-n", "2", "--raw", "--json"]) == 0
    _, last = _json_lines(capsys.readouterr().out)
    with GGUFFile(syn) as g:
        n = len(Tokenizer.from_gguf(g).encode("hello world", parse_special=True))
    assert last["metrics"]["prefill_tokens"] + last["metrics"]["reused_tokens"] == n


def test_saved_conversation_continues_and_reuses_system_prefix(
    syn: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["run", "--model", "syn", "-n", "3", "-t", "0", "--json", "--system", "Be brief."]
    assert main([*base, "-p", "hello", "--conversation", "new"]) == 0
    captured = capsys.readouterr()
    conv_id = captured.err.split("conversation ")[1].split()[0]
    _, first = _json_lines(captured.out)
    assert first["metrics"]["reused_tokens"] == 0
    assert main([*base, "-p", "the fox", "--conversation", conv_id]) == 0
    _, second = _json_lines(capsys.readouterr().out)
    # a new process would find the system prefix on disk; here it is the same cache folder
    assert second["metrics"]["reused_tokens"] > 0

    from npuchat.app.store import ConversationStore
    from npuchat.engine.paths import Paths

    store = ConversationStore.open(Paths.from_env().database_file)
    roles = [m.role for m in store.messages(conv_id)]
    store.close()
    assert roles == ["user", "assistant", "user", "assistant"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["run", "--model", "syn", "-p", "  "], "the prompt is empty"),
        (["run", "--model", "syn", "hello", "-p", "the fox"], "the prompt is given twice"),
        (["run", "--model", "syn", "-p", "x", "--logprobs", "2"], "add --json"),
        (["run", "--model", "syn", "-p", "x", "--json", "--logprobs", "21"], "--logprobs must be"),
        (["run", "--model", "syn", "-p", "x", "--draft", "qwen2.5-coder-0.5b"], "--draft none"),
        (["run", "--model", "syn", "-p", "x", "--system-file", "/no/file"], "--system-file"),
        (["run", "--model", "syn", "-p", "x", "--conversation", "nope"], "does not exist"),
        (["run", "--model", "missing", "-p", "x"], "unknown model 'missing'"),
    ],
)
def test_run_errors(
    syn: Path, args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_auto_device_says_what_it_chose(syn: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--model", "syn", "-p", "hi", "-n", "2", "--device", "auto"]) == 0
    assert "npuchat: device cpu (auto: " in capsys.readouterr().err
