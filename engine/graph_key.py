"""What names a built graph folder: the builder's version, the digest of its graph specs, and
the weights file every graph in it references.

Kept apart from `graph_builder` (which needs the `onnx` package) so that a start whose graphs are
already built never imports it: `onnx` pulls in `ml_dtypes`, ~0.6 s of every start measured on
this project's machines, for graphs that ONNX Runtime opens by itself.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

from .graph_inputs import GraphSpec

__all__ = ["BUILDER_VERSION", "WEIGHTS_FILE", "spec_digest"]

# Bump when the graphs or the weight layout change: it is part of the compile-cache key.
BUILDER_VERSION = "26"
WEIGHTS_FILE = "weights.bin"


def spec_digest(specs: Mapping[str, GraphSpec]) -> str:
    """A stable text of the graph set, for the compile-cache key."""
    blob = json.dumps({k: v.key() for k, v in sorted(specs.items())}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()
