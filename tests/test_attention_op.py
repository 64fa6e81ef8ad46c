"""The native `npuchat.Attention` op: numbers against a numpy attention (GQA, windows A < C,
hidden slots), a row the same bit for bit alone, among others and at any window that covers it,
the portable kernels too, and clear errors for shapes that do not fit."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from npuchat.engine.custom_ops import DOMAIN, kernel_library, register_kernels

if shutil.which("g++") is None or shutil.which("npm") is None:
    pytest.skip("building the kernels needs g++ and npm", allow_module_level=True)

TOLERANCE = 2e-5  # float32 sums in another order, and exp to ~2e-7


def session(threads: int = 2, **attrs: float) -> ort.InferenceSession:
    names = ["q", "k", "v", "mask"]
    node = helper.make_node("Attention", names, ["y"], domain=DOMAIN, **attrs)
    graph = helper.make_graph(
        [node],
        "attention",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)]
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    register_kernels(so, kernel_library())
    model = helper.make_model(graph, opset_imports=opsets)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """float64 softmax(q k^T + mask) v over the mask's A slots; rows g*S + s take mask row s."""
    rows = q.shape[2]
    s, a = mask.shape[2], mask.shape[3]
    tiled = np.tile(mask.astype(np.float64), (1, 1, rows // s, 1))  # [B, 1, G*S, A]
    scores = q.astype(np.float64) @ k[:, :, :a].astype(np.float64).transpose(0, 1, 3, 2) + tiled
    scores -= scores.max(-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(-1, keepdims=True)
    return p @ v[:, :, :a].astype(np.float64)


def inputs(
    rng: np.random.Generator, b: int, hkv: int, g: int, s: int, c: int, a: int, dh: int
) -> dict[str, np.ndarray]:
    """Random q/k/v and a causal-looking mask: row s of each sequence sees a prefix of slots."""
    mask = np.zeros((b, 1, s, a), np.float32)
    for bi in range(b):
        for si in range(s):
            seen = int(rng.integers(1, a + 1))
            mask[bi, 0, si, seen:] = -np.inf if (bi + si) % 2 else -30000.0
    return {
        "q": rng.standard_normal((b, hkv, g * s, dh)).astype(np.float32),
        "k": rng.standard_normal((b, hkv, c, dh)).astype(np.float32),
        "v": rng.standard_normal((b, hkv, c, dh)).astype(np.float32),
        "mask": mask,
    }


SHAPES = [  # b, hkv, g, s, c, a, dh
    (1, 2, 7, 1, 64, 40, 64),  # a decode step of a GQA model
    (2, 1, 4, 3, 50, 50, 16),  # batched verify rows, the whole cache
    (1, 3, 1, 5, 300, 257, 24),  # no GQA, a window past several column blocks, dh % 8 = 0
    (2, 2, 2, 2, 9, 1, 12),  # one slot; dh with a tail
    (1, 1, 3, 17, 2100, 2049, 80),  # many rows, a long window
    (1, 3, 3, 1, 300, 257, 64),  # a decode step of SmolLM2's shape: few rows, slots in lanes
    (2, 1, 4, 1, 100, 70, 256),  # Gemma 3's: four rows of 256 dims
    (1, 2, 1, 4, 120, 100, 64),  # no GQA, four tokens: few rows, each with its own mask row
]


@pytest.fixture(autouse=True)
def built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NPUCHAT_KERNELS", "on")
    lib = kernel_library()
    assert lib.available, lib.reason


@pytest.mark.parametrize("shape", SHAPES)
def test_attention_matches_numpy(shape: tuple[int, ...]) -> None:
    feed = inputs(np.random.default_rng(sum(shape)), *shape)
    y = session().run(None, feed)[0]
    ref = reference(**feed)
    assert y.shape == feed["q"].shape
    assert np.abs(y - ref).max() / np.abs(ref).max() < TOLERANCE


@pytest.mark.parametrize(
    "g, s, dh", [(3, 4, 32), (7, 9, 32), (1, 40, 32), (3, 4, 64), (4, 3, 128), (1, 40, 64)]
)
def test_a_row_is_the_same_alone_among_others_and_at_any_covering_window(
    g: int, s: int, dh: int
) -> None:
    """A decode row against its verify step or a prefill chunk (more rows, a wider window whose
    extra slots the mask hides) and against a batch: bit for bit, as exact speculation needs.
    (7, 9): rows over several tasks, two tokens in a vector of rows; (1, 40): eight tokens. With
    dh a multiple of 64 a lone token's 1-4 rows take the few-rows path (slots and dims in the
    lanes) and the many rows the eight-rows path: the same bits either way."""
    rng = np.random.default_rng(7)
    b, hkv, c = 3, 2, 200
    feed = inputs(rng, b, hkv, g, s, c, 130, dh)
    feed["k"][:, :, 130:] = 1e3  # slots past the window: never read
    wide = {**feed, "mask": np.full((b, 1, s, 190), -30000.0, np.float32)}
    wide["mask"][..., :130] = feed["mask"]
    two, one = session(2, hidden=-30000.0), session(1, hidden=-30000.0)
    together = two.run(None, feed)[0]
    assert np.array_equal(one.run(None, feed)[0], together)
    assert np.array_equal(two.run(None, wide)[0], together)
    q = feed["q"].reshape(b, hkv, g, s, dh)
    for bi in range(b):
        for si in range(s):
            alone = {
                "q": np.ascontiguousarray(q[bi : bi + 1, :, :, si]),
                "k": feed["k"][bi : bi + 1],
                "v": feed["v"][bi : bi + 1],
                "mask": feed["mask"][bi : bi + 1, :, si : si + 1],
            }
            y = two.run(None, alone)[0].reshape(hkv, g, dh)
            expected = together.reshape(b, hkv, g, s, dh)[bi, :, :, si]
            assert np.array_equal(y, expected), (bi, si)


@pytest.mark.parametrize("s, dh", [(4, 32), (1, 64)])  # (1, 64): the few-rows path
def test_slots_at_or_below_hidden_never_reach_the_result(s: int, dh: int) -> None:
    """`hidden`: the host's ignore value hides a slot outright; its K/V (NaN here) never reach
    the result, and the visible slots' result is numpy's over those slots alone."""
    rng = np.random.default_rng(11)
    feed = inputs(rng, 2, 2, 3, s, 300, 280, dh)
    feed["mask"][feed["mask"] == -np.inf] = -30000.0
    feed["mask"][0, 0, s - 1, 70:200] = -30000.0  # a hole: a window's row
    feed["mask"][..., 3:11] = -30000.0  # a hole every row has, inside the slots they see
    hidden = feed["mask"] <= -30000.0
    keep = ~np.broadcast_to(hidden.all(axis=(0, 2), keepdims=True), hidden.shape)[0, 0, 0]
    assert (~keep).any() and keep.any()
    feed["k"][:, :, :280][:, :, ~keep] = np.nan
    feed["v"][:, :, :280][:, :, ~keep] = np.nan
    y = session(hidden=-30000.0).run(None, feed)[0]
    ref_mask = np.where(hidden, -np.inf, 0.0).astype(np.float32)
    clean = {
        **feed,
        "k": np.nan_to_num(feed["k"]),
        "v": np.nan_to_num(feed["v"]),
        "mask": ref_mask,
    }
    ref = reference(**clean)
    assert np.isfinite(y).all()
    assert np.abs(y - ref).max() / np.abs(ref).max() < TOLERANCE
    with pytest.raises(Exception, match="hidden must be a number"):
        session(hidden=float("nan")).run(None, feed)


def test_the_portable_kernels_match_numpy_too() -> None:
    script = (
        "import numpy as np, sys; sys.path.insert(0, 'tests');"
        "import test_attention_op as t;"
        "from npuchat.engine.custom_ops import kernel_library;"
        "assert kernel_library().isa == 'scalar';"
        "errs = [];"
        "[errs.append(float(np.abs(t.session().run(None, f)[0] - t.reference(**f)).max()"
        " / np.abs(t.reference(**f)).max())) for f in"
        " (t.inputs(np.random.default_rng(sum(sh)), *sh) for sh in t.SHAPES[:4])];"
        "print(max(errs))"
    )
    env = dict(os.environ, NPUCHAT_KERNEL_ISA="scalar")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert float(proc.stdout.strip().splitlines()[-1]) < TOLERANCE


def test_shapes_that_do_not_fit_are_refused_with_a_reason() -> None:
    feed = inputs(np.random.default_rng(9), 1, 2, 2, 3, 20, 20, 8)
    s = session()
    bad = {
        "slots wide but the cache holds 20": {"mask": np.zeros((1, 1, 3, 21), np.float32)},
        "must be \\[B, 1, S, A\\]": {"mask": np.zeros((1, 1, 4, 20), np.float32)},
        "does not fit the cache": {"q": np.zeros((1, 2, 6, 16), np.float32)},
        "differ": {"v": np.zeros((1, 2, 19, 8), np.float32)},
        "must all be 4-D": {"q": np.zeros((2, 6, 8), np.float32)},
    }
    for message, change in bad.items():
        with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument, match=message):
            s.run(None, {**feed, **change})
