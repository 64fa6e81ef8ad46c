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
from npuchat.engine.npu_compile import adapt_for_htp

__all__ = ["htp_sources"]


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
