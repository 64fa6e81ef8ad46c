"""GGUF reader: ModelConfig for every supported arch, tensor directory, and clear errors.

Synthetic files are written here with known hyperparameters, so every ModelConfig field is
checked against what was written; the tensor directory and bytes are checked against gguf-py's
own (slow, independent) `GGUFReader`. The real models' configs are checked against their
published shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, TokenType
from gguf.quants import dequantize
from synthetic import ARCHS, TENSOR_TYPES, ggml_type, quantize_tensor, write_synthetic_gguf

from npuchat.engine.errors import NpuchatError, UnsupportedModelError
from npuchat.engine.gguf_reader import GGUFFile, GGUFFormatError, read_config
from npuchat.engine.model_config import RopeScaling

MakeGGUF = Callable[..., Path]

# What write_synthetic_gguf writes per arch (mirrors SmolLM2 / Qwen2.5 / Phi-3 conventions).
EXPECTED_ARCH = {
    "llama": {"rope_theta": 100000.0, "rms_eps": 1e-5, "tied": True, "n_vocab": 403},
    "qwen2": {"rope_theta": 1000000.0, "rms_eps": 1e-6, "tied": False, "n_vocab": 403},
    "phi3": {"rope_theta": 10000.0, "rms_eps": 1e-5, "tied": False, "n_vocab": 481},
    "qwen3": {"rope_theta": 1000000.0, "rms_eps": 1e-6, "tied": True, "n_vocab": 403},
    "gemma3": {"rope_theta": 1000000.0, "rms_eps": 1e-6, "tied": True, "n_vocab": 479},
}
WIDE_HEADS = ("qwen3", "gemma3")  # head_dim = 2 * d_model / n_heads in the synthetic files


def _check_config(
    path: Path,
    arch: str,
    *,
    n_layers: int,
    d_model: int,
    n_heads: int,
    n_kv_heads: int,
    ffn_dim: int,
    context_length: int,
    tied: bool,
) -> None:
    exp = EXPECTED_ARCH[arch]
    cfg = read_config(path)
    assert cfg.arch == arch
    assert cfg.name == f"synthetic-{arch}"
    assert cfg.n_layers == n_layers
    assert cfg.d_model == d_model
    assert cfg.n_heads == n_heads
    assert cfg.n_kv_heads == n_kv_heads
    assert cfg.head_dim == (2 if arch in WIDE_HEADS else 1) * d_model // n_heads
    assert cfg.n_groups == n_heads // n_kv_heads
    assert cfg.ffn_dim == ffn_dim
    assert cfg.vocab_size == exp["n_vocab"]
    assert cfg.context_length == context_length
    assert cfg.rope_theta == exp["rope_theta"]
    assert cfg.rope_dim == cfg.head_dim
    assert cfg.qk_norm is (arch in WIDE_HEADS)
    assert cfg.post_norms is (arch == "gemma3")
    assert cfg.activation == ("gelu_tanh" if arch == "gemma3" else "silu")
    assert cfg.embed_scale == pytest.approx(np.sqrt(d_model) if arch == "gemma3" else 1.0)
    assert cfg.q_scale == pytest.approx(1 / np.sqrt(cfg.head_dim))
    if arch == "gemma3":  # window 8 on every other layer (pattern 2), sliding base 10000
        assert cfg.sliding_window == 8 and cfg.rope_theta_swa == 10000.0
        assert cfg.swa_layers == tuple(i % 2 == 0 for i in range(n_layers))
    else:
        assert cfg.sliding_window == 0 and cfg.swa_layers == ()
    orig_ctx = context_length if arch == "phi3" else 0
    assert cfg.rope_scaling == RopeScaling("none", 1.0, orig_ctx)
    assert cfg.rms_eps == pytest.approx(exp["rms_eps"], rel=1e-6)
    assert cfg.tied_embeddings is tied
    assert cfg.qkv_bias is (arch == "qwen2")
    assert cfg.fused_qkv is (arch == "phi3")
    assert cfg.fused_gate_up is (arch == "phi3")


@pytest.mark.parametrize("arch", ARCHS)
def test_config_defaults_per_arch(arch: str, synthetic_gguf: MakeGGUF) -> None:
    _check_config(
        synthetic_gguf(arch),
        arch,
        n_layers=2,
        d_model=64,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=128,
        context_length=512,
        tied=EXPECTED_ARCH[arch]["tied"],
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_config_custom_dims(arch: str, tmp_path: Path) -> None:
    tied = not EXPECTED_ARCH[arch]["tied"]
    dims = {"n_layers": 3, "d_model": 96, "n_heads": 6, "n_kv_heads": 3, "ffn_dim": 160}
    path = write_synthetic_gguf(
        tmp_path / "m.gguf",
        arch,
        tensor_type="f16",
        context_length=1024,
        tied_embeddings=tied,
        **dims,
    )
    _check_config(path, arch, context_length=1024, tied=tied, **dims)


def _expected_tensors(arch: str, n_layers: int, tied: bool) -> set[str]:
    per_layer = ["attn_norm.weight", "attn_output.weight", "ffn_norm.weight", "ffn_down.weight"]
    per_layer += (
        ["attn_qkv.weight", "ffn_up.weight"]
        if arch == "phi3"
        else ["attn_q.weight", "attn_k.weight", "attn_v.weight", "ffn_gate.weight", "ffn_up.weight"]
    )
    if arch == "qwen2":
        per_layer += ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
    if arch in ("qwen3", "gemma3"):
        per_layer += ["attn_q_norm.weight", "attn_k_norm.weight"]
    if arch == "gemma3":
        per_layer += ["post_attention_norm.weight", "post_ffw_norm.weight"]
    names = {f"blk.{i}.{n}" for i in range(n_layers) for n in per_layer}
    names |= {"token_embd.weight", "output_norm.weight"}
    if not tied:
        names.add("output.weight")
    return names


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tensor_type", TENSOR_TYPES)
def test_tensor_directory_matches_gguf_py(
    arch: str, tensor_type: str, synthetic_gguf: MakeGGUF
) -> None:
    """Names, GGML shapes, types and bytes agree with gguf-py's independent parser."""
    path = synthetic_gguf(arch, tensor_type)
    g = GGUFFile(path)
    cfg = g.config
    assert set(g.tensors) == _expected_tensors(arch, cfg.n_layers, cfg.tied_embeddings)
    qtype = ggml_type(tensor_type)
    d, f, kv = cfg.d_model, cfg.ffn_dim, cfg.n_kv_heads * cfg.head_dim
    assert g.tensors["blk.0.attn_output.weight"].shape == (cfg.n_heads * cfg.head_dim, d)
    assert g.tensors["token_embd.weight"].shape == (d, cfg.vocab_size)
    assert g.tensors["blk.0.ffn_down.weight"].shape == (f, d)
    if arch == "phi3":
        assert g.tensors["blk.0.attn_qkv.weight"].shape == (d, d + 2 * kv)
        assert g.tensors["blk.0.ffn_up.weight"].shape == (d, 2 * f)
    else:
        assert g.tensors["blk.0.attn_k.weight"].shape == (d, kv)
        assert g.tensors["blk.0.ffn_gate.weight"].shape == (d, f)
    ref = GGUFReader(path)
    assert len(ref.tensors) == len(g.tensors)
    for t in ref.tensors:
        info = g.tensors[t.name]
        assert info.shape == tuple(int(n) for n in t.shape)
        assert info.ggml_type == t.tensor_type
        is_matrix = len(info.shape) == 2
        assert info.ggml_type == (qtype if is_matrix else GGMLQuantizationType.F32)
        assert info.n_bytes == t.n_bytes
        assert np.array_equal(g.raw(t.name), np.asarray(t.data).reshape(-1).view(np.uint8))


@pytest.mark.parametrize("arch", ARCHS)
def test_metadata_tokenizer_arrays(arch: str, synthetic_gguf: MakeGGUF) -> None:
    m = GGUFFile(synthetic_gguf(arch)).metadata
    tokens = m["tokenizer.ggml.tokens"]
    types = m["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == len(set(tokens))
    eos = tokens[m["tokenizer.ggml.eos_token_id"]]
    assert eos in ("<|im_end|>", "<|endoftext|>", "<eos>")
    control = {tokens[i] for i in np.flatnonzero(types == TokenType.CONTROL)}
    if arch == "gemma3":
        assert m["tokenizer.ggml.model"] == "llama"
        assert control == {"<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"}
        assert m["tokenizer.ggml.add_space_prefix"] is False
        assert "<start_of_turn>" in m["tokenizer.chat_template"]
    elif arch == "phi3":
        assert m["tokenizer.ggml.model"] == "llama"
        assert {"<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"} <= control
        assert int((types == TokenType.BYTE).sum()) == 256
        assert tokens[m["tokenizer.ggml.eot_token_id"]] == "<|end|>"
        assert len(m["tokenizer.ggml.scores"]) == len(tokens)
        assert "<|user|>" in m["tokenizer.chat_template"]
    else:
        assert m["tokenizer.ggml.model"] == "gpt2"
        assert m["tokenizer.ggml.pre"] == ("smollm" if arch == "llama" else "qwen2")
        assert control == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
        vocab = set(tokens)
        for merge in m["tokenizer.ggml.merges"]:  # every merge joins two tokens into a token
            a, b = merge.split(" ")
            assert a in vocab and b in vocab and a + b in vocab
        assert "<|im_start|>" in m["tokenizer.chat_template"]


def test_synthetic_files_are_deterministic(tmp_path: Path) -> None:
    a = write_synthetic_gguf(tmp_path / "a.gguf", "qwen2", tensor_type="q4_k", seed=3)
    b = write_synthetic_gguf(tmp_path / "b.gguf", "qwen2", tensor_type="q4_k", seed=3)
    c = write_synthetic_gguf(tmp_path / "c.gguf", "qwen2", tensor_type="q4_k", seed=4)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()


def test_mixed_tensor_types(synthetic_gguf: MakeGGUF) -> None:
    """Per-role types, like a real Q4_K_M file (Q4_K with Q6_K for ffn_down and the head)."""
    spec = {"default": "q4_k", "ffn_down": "q6_k", "output": "q6_k", "token_embd": "q8_0"}
    g = GGUFFile(synthetic_gguf("qwen2", spec))
    T = GGMLQuantizationType
    assert g.tensors["blk.1.ffn_down.weight"].ggml_type == T.Q6_K
    assert g.tensors["output.weight"].ggml_type == T.Q6_K
    assert g.tensors["token_embd.weight"].ggml_type == T.Q8_0
    assert g.tensors["blk.0.attn_v.weight"].ggml_type == T.Q4_K
    assert g.config.d_model == 256  # K-quants force rows of 256


@pytest.mark.parametrize(
    ("tensor_type", "max_rel_rms"),
    [("q8_0", 0.01), ("q6_k", 0.03), ("q5_0", 0.06), ("q4_k", 0.1), ("q4_1", 0.1), ("q4_0", 0.1)],
)
def test_quantizers_round_trip(tensor_type: str, max_rel_rms: float) -> None:
    """Our K-quant packers (and gguf-py's others) invert gguf-py's dequantizers."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 512)).astype(np.float32) / 20
    qtype = ggml_type(tensor_type)
    y = dequantize(quantize_tensor(x, qtype), qtype).reshape(x.shape)
    assert np.sqrt(np.mean((y - x) ** 2)) / x.std() < max_rel_rms


# --------------------------------------------------------------------------- real models


@pytest.mark.realmodel
@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            "smollm2-135m",
            {
                "arch": "llama",
                "n_layers": 30,
                "d_model": 576,
                "n_heads": 9,
                "n_kv_heads": 3,
                "head_dim": 64,
                "ffn_dim": 1536,
                "vocab_size": 49152,
                "context_length": 8192,
                "rope_theta": 100000.0,
                "rope_dim": 64,
                "tied_embeddings": True,
                "qkv_bias": False,
                "fused_qkv": False,
                "fused_gate_up": False,
            },
        ),
        (
            "qwen2.5-coder-0.5b",
            {
                "arch": "qwen2",
                "n_layers": 24,
                "d_model": 896,
                "n_heads": 14,
                "n_kv_heads": 2,
                "head_dim": 64,
                "ffn_dim": 4864,
                "vocab_size": 151936,
                "context_length": 32768,
                "rope_theta": 1000000.0,
                "rope_dim": 64,
                "tied_embeddings": False,
                "qkv_bias": True,
                "fused_qkv": False,
                "fused_gate_up": False,
            },
        ),
    ],
)
def test_real_model_config(
    name: str, expected: dict[str, Any], real_gguf: Callable[[str], Path]
) -> None:
    cfg = read_config(real_gguf(name))
    for field, value in expected.items():
        assert getattr(cfg, field) == value, field
    assert cfg.rope_scaling.type == "none"
    assert 1e-7 < cfg.rms_eps <= 1e-5


# --------------------------------------------------------------------------- errors


def _one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert "\n" not in msg and msg
    return msg


def test_unsupported_arch_is_named(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    w = GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = GGUFFile(path)  # the container is fine; only the config is refused
    with pytest.raises(UnsupportedModelError) as err:
        _ = g.config
    msg = _one_line(err.value)
    assert "'gpt2'" in msg
    for arch in ARCHS:
        assert arch in msg


def test_missing_required_key(tmp_path: Path) -> None:
    path = tmp_path / "nokey.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_embedding_length(8)
    w.add_head_count(2)
    w.add_tensor("token_embd.weight", np.zeros((8, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match=r"llama\.block_count"):
        read_config(path)


@pytest.mark.parametrize("keep", [0.5, 0.99, 0.02])
def test_truncated_file(keep: float, synthetic_gguf: MakeGGUF, tmp_path: Path) -> None:
    """Cut in the tensor data (0.5, 0.99) or inside the header's tokenizer arrays (0.02)."""
    data = synthetic_gguf("llama").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(GGUFFormatError) as err:
        GGUFFile(cut)
    msg = _one_line(err.value)
    assert "truncated" in msg and "cut.gguf" in msg


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_text("this is not a model\n" * 10)
    with pytest.raises(GGUFFormatError, match="not a GGUF"):
        GGUFFile(bogus)


def test_empty_and_missing_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty.gguf"
    empty.touch()
    with pytest.raises(GGUFFormatError, match="empty"):
        GGUFFile(empty)
    with pytest.raises(NpuchatError, match="no such file"):
        GGUFFile(tmp_path / "absent.gguf")
