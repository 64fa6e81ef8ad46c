"""How many bytes a model's compiled NPU graph set takes, against the weights it came from.

The QNN EP bakes each graph's weights into its context binary (quantized ones stay quantized:
one q4_0 graph's binary is ~1.05× its matrices' GGUF bytes), so the binaries' total over the
GGUF's tensor bytes counts the copies of the weights the NPU holds. A binary per graph shape
made that about the number of shapes (~3); the engine's one step graph (`npu_compile`) keeps
it near 1 (the embedding table stays on the host, the graph itself adds ~150 KB).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .gguf_reader import GGUFFile

BINARY_SUFFIX = "_qnn.bin"


@dataclass(frozen=True)
class BinarySizes:
    """The context binaries of one compiled folder, and the GGUF tensor bytes behind them."""

    binaries: dict[str, int]  # file name -> bytes
    tensor_bytes: int  # every tensor's data in the GGUF (embedding, matrices, norms, biases)

    @property
    def binary_bytes(self) -> int:
        return sum(self.binaries.values())

    @property
    def ratio(self) -> float:
        return self.binary_bytes / self.tensor_bytes if self.tensor_bytes else 0.0


def gguf_tensor_bytes(gguf_path: Path) -> int:
    """The bytes of every tensor's data in the GGUF (the file less its header and vocabulary)."""
    with GGUFFile(gguf_path) as g:
        return sum(t.n_bytes for t in g.tensors.values())


def binary_bytes(folder: Path) -> dict[str, int]:
    """The `*_qnn.bin` context binaries in a compiled folder: file name -> bytes."""
    return {p.name: p.stat().st_size for p in sorted(folder.glob(f"*{BINARY_SUFFIX}"))}


def binary_sizes(folder: Path, gguf_path: Path) -> BinarySizes:
    """A compiled folder's context binaries against the tensor bytes of `gguf_path`."""
    return BinarySizes(binary_bytes(folder), gguf_tensor_bytes(gguf_path))


def describe(n_binaries: int, binary_bytes: int, tensor_bytes: int) -> str:
    """One line for doctor and the bench: the binaries' total and how many weight copies."""
    mib = 1024 * 1024
    ratio = binary_bytes / tensor_bytes if tensor_bytes else 0.0
    return (
        f"{n_binaries} context binaries, {binary_bytes / mib:.1f} MiB = {ratio:.2f}× "
        f"the GGUF's tensor bytes ({tensor_bytes / mib:.1f} MiB)"
    )
