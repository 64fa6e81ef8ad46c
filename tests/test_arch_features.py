"""Features a GGUF asks for: every one the engine does not implement is refused, by name, at
import and at load; the ones it implements change the math (the reference sees the difference)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter
from reference_forward import ReferenceModel
from synthetic import write_synthetic_gguf
from synthetic_archs import llama3_freq_factors

from npuchat.app.cli import main
from npuchat.engine.errors import UnsupportedModelError
from npuchat.engine.gguf_reader import read_config
from npuchat.engine.model import Model

Extra = Callable[[GGUFWriter], None]


def _key(name: str, value: float | bool | str) -> Extra:
    def add(w: GGUFWriter) -> None:
        if isinstance(value, bool):
            w.add_bool(name, value)
        elif isinstance(value, str):
            w.add_string(name, value)
        elif isinstance(value, int):
            w.add_uint32(name, value)
        else:
            w.add_float32(name, value)

    return add


def _tensor(name: str, n: int = 8) -> Extra:
    return lambda w: w.add_tensor(name, np.ones(n, np.float32))


# (arch, what the file adds, words the one-line refusal must contain)
REFUSED: list[tuple[str, Extra, str]] = [
    ("llama", _key("llama.rope.scaling.type", "yarn"), "rope scaling 'yarn'"),
    ("qwen2", _key("qwen2.rope.scaling.yarn_log_multiplier", 0.1), "YaRN"),
    ("llama", _key("llama.rope.scaling.attn_factor", 2.0), "rope attention factor"),
    ("gemma3", _key("gemma3.attn_logit_softcapping", 50.0), "attention logit soft-capping"),
    ("gemma3", _key("gemma3.final_logit_softcapping", 30.0), "final logit soft-capping"),
    ("llama", _key("llama.expert_count", 8), "mixture-of-experts (8 experts)"),
    ("qwen3", _key("qwen3.expert_used_count", 2), "mixture-of-experts"),
    ("llama", _key("llama.attention.max_alibi_bias", 8.0), "ALiBi"),
    ("llama", _key("llama.attention.causal", False), "non-causal attention"),
    ("qwen2", _key("qwen2.attention.sliding_window", 64), "sliding-window attention on qwen2"),
    ("llama", _key("llama.attention.sliding_window_pattern", 4), "interleaved sliding-window"),
    ("llama", _key("llama.logit_scale", 0.5), "logit scaling"),
    ("llama", _key("llama.attention.value_length", 8), "different K and V head sizes"),
    ("llama", _tensor("blk.0.ffn_gate_exps.weight"), "mixture-of-experts expert tensors"),
    ("qwen3", _tensor("blk.1.ffn_gate_inp.weight"), "mixture-of-experts router"),
    ("llama", _tensor("blk.0.attn_output.bias", 64), "a bias the graphs do not add"),
    ("qwen3", _tensor("blk.0.attn_q.bias", 128), "a bias the graphs do not add"),
    ("phi3", _tensor("rope_factors_long.weight"), "longrope"),
    ("qwen2", _tensor("rope_freqs.weight"), "per-frequency rope factors"),
    ("llama", _tensor("blk.0.attn_q_norm.weight", 16), "a norm the graphs do not apply"),
    ("gemma3", _tensor("dense_2_out.weight"), "extra dense projections"),
    ("llama", _tensor("blk.7.attn_norm.weight", 64), "tensor blk.7.attn_norm.weight"),
]


@pytest.mark.parametrize(("arch", "extra", "words"), REFUSED, ids=[r[2] for r in REFUSED])
def test_unimplemented_feature_is_refused_by_name(
    tmp_path: Path, arch: str, extra: Extra, words: str
) -> None:
    path = write_synthetic_gguf(tmp_path / "m.gguf", arch, extra=extra)
    with pytest.raises(UnsupportedModelError) as err:
        read_config(path)
    msg = str(err.value)
    assert "\n" not in msg and words in msg and "not implemented" in msg
    with pytest.raises(UnsupportedModelError, match="not implemented"):
        Model.load(path, cache_dir=tmp_path / "cache")


def test_import_refuses_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    extra = _key("gemma3.final_logit_softcapping", 30.0)
    path = write_synthetic_gguf(tmp_path / "m.gguf", "gemma3", extra=extra)
    assert main(["import", str(path), "--name", "capped"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "final logit soft-capping is not implemented" in err
    assert main(["models", "--json"]) == 0
    assert "capped" not in capsys.readouterr().out


def test_features_the_engine_implements_are_accepted(tmp_path: Path) -> None:
    """Zero-valued keys mean "off" (converters write them), and each arch's own tensors pass."""
    off = _key("llama.attn_logit_softcapping", 0.0)
    assert read_config(write_synthetic_gguf(tmp_path / "a.gguf", "llama", extra=off)).arch
    cfg = read_config(write_synthetic_gguf(tmp_path / "b.gguf", "llama", rope_freq_factors=True))
    assert cfg.rope_freq_factors == tuple(llama3_freq_factors(cfg.head_dim).tolist())
    cfg = read_config(write_synthetic_gguf(tmp_path / "c.gguf", "llama", sliding_window=16))
    assert cfg.sliding_window == 16 and all(cfg.swa_layers) and not cfg.mixed_windows


@pytest.mark.parametrize(
    ("kw", "feature"),
    [
        ({"rope_freq_factors": True}, "freq_factors"),
        ({"sliding_window": 6}, "window"),
    ],
)
def test_llama_features_change_the_logits(tmp_path: Path, kw: dict, feature: str) -> None:
    """Negative control: the reference without the feature disagrees beyond the shared part,
    so the graph tests that match the reference with it do check the feature."""
    ref = ReferenceModel(write_synthetic_gguf(tmp_path / "m.gguf", "llama", **kw))
    ids = np.random.default_rng(5).integers(0, ref.config.vocab_size, 24)
    with_it = ref.logits(ids)
    if feature == "window":
        ref.sliding = [False] * ref.config.n_layers
    else:
        ref.freq_factors = None
    without = ref.logits(ids)
    if feature == "window":  # identical while every row sees all of its past
        np.testing.assert_allclose(with_it[:6], without[:6], rtol=1e-10, atol=1e-10)
    assert np.abs(with_it[8:] - without[8:]).max() > 1e-2


@pytest.mark.parametrize(
    "extra",
    [
        _key("gemma3.attention.sliding_window_pattern", "every sixth"),
        _key("gemma3.attention.sliding_window", "wide"),
        _key("gemma3.expert_count", "many"),
    ],
)
def test_malformed_feature_keys_are_one_line_errors(tmp_path: Path, extra: Extra) -> None:
    """A feature key of the wrong type is refused in one line naming it, never crashes."""
    path = write_synthetic_gguf(tmp_path / "m.gguf", "gemma3", extra=extra)
    with pytest.raises(UnsupportedModelError) as err:
        read_config(path)
    assert "\n" not in str(err.value) and "gemma3." in str(err.value)
