"""Device selection: the names a user may ask for, which devices exist here (the CPU always,
the Qualcomm NPU through the QNN plugin EP), and which one `auto` means.

`onnxruntime-qnn` is a *plugin* execution provider: its library is registered with
`onnxruntime.register_execution_provider_library` and then shows up in `get_ep_devices()`, one
`OrtEpDevice` per hardware device it can drive. Sessions select it with
`SessionOptions.add_provider_for_devices` (not with a `providers=[...]` name list).

On a Snapdragon laptop the QNN EP reports an NPU hardware device (the Hexagon HTP). The x86
wheel reports the host CPU instead: there its HTP backend is a *simulator* — exact, but ~50–100×
slower than the CPU EP. That is why `auto` picks the NPU only where it is real hardware, while an
explicit `npu` still runs on the simulator (tests, and proving placement and numerics).

ONNX Runtime is imported when a device is first probed, not with this module, so the command
line can offer `DEVICE_CHOICES` without loading it.
"""

from __future__ import annotations

import functools
import platform
import threading
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from .errors import NpuchatError

if TYPE_CHECKING:
    from types import ModuleType

QNN_EP = "QNNExecutionProvider"
DEVICES = ("cpu", "npu")
"""Where a model runs."""
DEVICE_CHOICES = ("auto", *DEVICES)
"""What a user may ask for (`--device`, `device` and `draft_device` in config.toml)."""
DEFAULT_SOC_MODEL = 60  # the simulator's default target: Snapdragon 8 Gen 3 class
DEFAULT_HTP_ARCH = 73  # Hexagon v73

_lock = threading.Lock()


@dataclass(frozen=True)
class QnnOptions:
    """QNN EP provider options that change the compiled context binary (part of its cache key).

    `soc_model` and `htp_arch` name the target chip for offline preparation; 0 leaves the
    option out so QNN uses the chip it runs on. fp16 precision is on: the HTP computes float
    graphs in fp16 (it has no fp32 vector path), which is what the tolerances assume.
    """

    soc_model: int = DEFAULT_SOC_MODEL
    htp_arch: int = DEFAULT_HTP_ARCH
    backend_type: str = "htp"
    fp16_precision: bool = True

    def provider_options(self) -> dict[str, str]:
        opts = {
            "backend_type": self.backend_type,
            "enable_htp_fp16_precision": "1" if self.fp16_precision else "0",
        }
        if self.soc_model:
            opts["soc_model"] = str(self.soc_model)
        if self.htp_arch:
            opts["htp_arch"] = str(self.htp_arch)
        return opts

    def key(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class EpDeviceInfo:
    """One (execution provider, hardware device) pair that ONNX Runtime reports."""

    ep_name: str
    ep_vendor: str
    hardware_type: str  # CPU, GPU or NPU
    hardware_vendor: str


@dataclass(frozen=True)
class NpuStatus:
    """What the machine offers for `--device npu`, and why not when it offers nothing."""

    available: bool
    simulated: bool
    reason: str
    qnn_package_version: str
    qairt_version: str

    @property
    def kind(self) -> str:
        if not self.available:
            return "unavailable"
        return "HTP simulator (x86)" if self.simulated else "Hexagon NPU (hardware)"


def _package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return ""


def _ort() -> ModuleType:
    import onnxruntime  # type: ignore[import-untyped]

    return onnxruntime


def onnxruntime_version() -> str:
    return str(_ort().__version__)


@functools.cache
def qnn_versions() -> tuple[str, str]:
    """(onnxruntime-qnn package version, QAIRT/QNN SDK version it was built with), or ""."""
    try:
        from onnxruntime_qnn import build_and_package_info as info  # type: ignore[import-untyped]
    except ImportError:
        return _package_version("onnxruntime-qnn"), ""
    return str(getattr(info, "__version__", "")), str(getattr(info, "qnn_version", ""))


@functools.cache
def _register_qnn() -> str:
    """Register the QNN plugin library once per process; "" on success, else why not."""
    try:
        import onnxruntime_qnn
    except ImportError:
        return "onnxruntime-qnn is not installed (pip install onnxruntime-qnn)"
    if any(d.ep_name == QNN_EP for d in _ort().get_ep_devices()):
        return ""  # someone in this process registered it already
    try:
        _ort().register_execution_provider_library(QNN_EP, onnxruntime_qnn.get_library_path())
    except Exception as exc:  # the library failed to load: missing or foreign binaries
        return f"the QNN plugin library did not load ({str(exc).splitlines()[0][:160]})"
    return ""


def qnn_ep_devices() -> list[Any]:
    """The `OrtEpDevice`s of the QNN EP (registering the plugin first); empty if none."""
    with _lock:
        if _register_qnn():
            return []
        return [d for d in _ort().get_ep_devices() if d.ep_name == QNN_EP]


def list_ep_devices() -> list[EpDeviceInfo]:
    """Every (EP, device) pair ONNX Runtime knows, after registering the QNN plugin."""
    qnn_ep_devices()
    return [
        EpDeviceInfo(
            d.ep_name,
            d.ep_vendor,
            d.device.type.name,
            d.device.vendor,
        )
        for d in _ort().get_ep_devices()
    ]


def _is_npu(dev: Any) -> bool:
    return bool(dev.device.type == _ort().OrtHardwareDeviceType.NPU)


def npu_status() -> NpuStatus:
    """Whether the QNN HTP backend exists here, and whether it is hardware or the simulator.

    Hardware = the QNN EP reports an NPU device. Without one, the x86 wheel still runs HTP
    graphs through its simulator, bound to the host CPU device; an ARM machine without an NPU
    device has no usable HTP.
    """
    pkg, qairt = qnn_versions()
    reason = _register_qnn()
    if reason:
        return NpuStatus(False, False, reason, pkg, qairt)
    devices = qnn_ep_devices()
    if any(_is_npu(d) for d in devices):
        return NpuStatus(True, False, "", pkg, qairt)
    if devices and platform.machine().lower() in ("x86_64", "amd64"):
        return NpuStatus(True, True, "", pkg, qairt)
    return NpuStatus(False, False, "the QNN EP found no Hexagon NPU on this machine", pkg, qairt)


def htp_device() -> Any:
    """The `OrtEpDevice` to run HTP graphs on: the NPU if present, else the simulator's host."""
    status = npu_status()
    if not status.available:
        raise NpuchatError(f"the NPU is not available: {status.reason}; use --device cpu")
    devices = qnn_ep_devices()
    npus = [d for d in devices if _is_npu(d)]
    return (npus or devices)[0]


def pick_device(requested: str) -> str:
    """`cpu` or `npu` for `npu`, `cpu` or `auto`/"" (see `resolve_device`)."""
    return resolve_device(requested)[0]


def resolve_device(requested: str) -> tuple[str, str]:
    """(`cpu` or `npu`, a one-line note saying why) for `npu`, `cpu` or `auto`/"".

    `auto` takes the NPU only when it is real hardware: the simulator is far slower than the CPU.
    An explicit `npu` must exist (hardware or simulator), or it is an error rather than a
    silent CPU run.
    """
    if requested == "cpu":
        return "cpu", "cpu (requested)"
    if requested == "npu":
        status = npu_status()
        if not status.available:
            raise NpuchatError(f"--device npu: {status.reason}; use --device cpu or auto")
        return "npu", f"npu: {status.kind} (requested)"
    if requested in ("", "auto"):
        status = npu_status()
        if status.available and not status.simulated:
            return "npu", f"npu: {status.kind} (auto)"
        why = "only the x86 HTP simulator, slower than the CPU" if status.available else "no NPU"
        return "cpu", f"cpu (auto: {why})"
    raise NpuchatError(f"unknown device {requested!r}; use one of {', '.join(DEVICE_CHOICES)}")
