"""The synthetic model the NPU scripts compile: a q4_0 Llama's graphs, built and adapted for HTP.

`npu_profile.py` and `npu_shared_context.py` measure different things on the same kind of
model; one function writes it, so their figures describe the same graphs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import onnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from synthetic import write_synthetic_gguf

from npuchat.engine.graph_builder import GraphSpec, build_graphs
from npuchat.engine.npu_adapt import adapt_for_htp

__all__ = ["htp_sources", "shape_specs"]


def shape_specs(prefill_chunk: int, verify_k: int, capacity: int) -> dict[str, GraphSpec]:
    """A graph per step shape (the engine's design before its one step graph): `decode`
    (S = 1), `prefill` (S = P, last row's logits), `verify` (S = k+1, every row's logits)."""
    k1 = verify_k + 1
    return {
        "decode": GraphSpec.static(1, capacity, 1, 0),
        "prefill": GraphSpec.static(prefill_chunk, capacity, 1, 0),
        "verify": GraphSpec.static(k1, capacity, k1, 0),
    }


def htp_sources(
    folder: Path, specs: dict[str, GraphSpec], layers: int, d_model: int
) -> tuple[Path, dict[str, Path]]:
    """Write the model under `folder` and its graphs for `specs`, each rewritten in place into
    the ops the HTP runs (`adapt_for_htp`); returns the GGUF and the graph files by name."""
    gguf = write_synthetic_gguf(
        folder / "m.gguf",
        "llama",
        tensor_type="q4_0",
        n_layers=layers,
        d_model=d_model,
        ffn_dim=3 * d_model,
        tied_embeddings=False,
    )
    sources = build_graphs(gguf, specs, folder / "src")
    for src in sources.values():
        onnx.save_model(adapt_for_htp(onnx.load(str(src), load_external_data=False)), str(src))
    return gguf, sources
