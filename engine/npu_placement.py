"""Where a graph's nodes run on the QNN HTP, and why a node does not: the explanation path.

An NPU compile with CPU fallback disabled fails on the first op the HTP rejects, and ONNX
Runtime's error names no node. `diagnose` places the same graph *with* fallback allowed and
reads QNN's verbose log for each rejected node's reason, so doctor and a failed compile can say
which nodes cannot run and why. This module also holds the session plumbing both paths share
(HTP session options, the simulator's stdout banner sent to stderr, one-line errors); the
compiling itself and its cache are in `npu_compile`.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import onnxruntime as ort  # type: ignore[import-untyped]

from .devices import QNN_EP, QnnOptions, htp_device, npu_status
from .errors import NpuchatError


@dataclass
class Fallback:
    """A node the HTP would not take, and QNN's reason (when it logged one)."""

    node: str
    op_type: str
    reason: str


@dataclass
class GraphPlacement:
    """Where the nodes of one graph run: all on the NPU, or these fall back."""

    graph: str
    total_nodes: int
    npu_nodes: int
    fallbacks: list[Fallback] = field(default_factory=list)

    @property
    def fraction(self) -> float:
        return self.npu_nodes / self.total_nodes if self.total_nodes else 0.0

    @property
    def complete(self) -> bool:
        return self.total_nodes > 0 and self.npu_nodes == self.total_nodes

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GraphPlacement:
        falls = [Fallback(**f) for f in data.get("fallbacks", [])]
        return cls(str(data["graph"]), int(data["total_nodes"]), int(data["npu_nodes"]), falls)


_REASON = re.compile(r"Node name: (?P<node>\S+).*?REASON\s*:\s*(?P<reason>[^\n]+)", re.S)
_log_lock = threading.Lock()


@contextmanager
def _captured_ort_log() -> Iterator[list[str]]:
    """Collect ONNX Runtime's log messages (verbose) while the block runs.

    QNN explains each rejected node only in its verbose log ("Validation FAILED … REASON : …").
    The session that wants them logs at verbose level; the process-wide default stays at errors
    (so ORT's own threads do not spray verbose lines on the platform sink), and the callback is
    installed for the block only.
    """
    messages: list[str] = []
    with _log_lock:
        ort.set_default_logger_callback(lambda sev, cat, lid, loc, msg: messages.append(msg), 3)
        try:
            yield messages
        finally:
            ort.set_default_logger_callback(None)
            ort.set_default_logger_severity(3)


@contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send file descriptor 1 to stderr while the QNN backend starts (simulator only).

    The x86 HTP simulator prints a banner (`# LIBNATIVE: …`) straight to fd 1, which would
    corrupt `npuchat run --json` output; stderr is where diagnostics belong. Real hardware
    prints nothing, and there fd 1 is left alone (the TUI may be drawing on it meanwhile).
    """
    if not npu_status().simulated:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def new_session(path: Path, so: ort.SessionOptions) -> ort.InferenceSession:
    """Open a session on the HTP; serialized with the log capture, simulator banner to stderr."""
    with _log_lock, _stdout_to_stderr():
        return ort.InferenceSession(str(path), so)


def session_options(opts: QnnOptions, fallback: bool) -> ort.SessionOptions:
    """Options selecting the HTP device; `fallback=False` makes a rejected op fail the session."""
    so = ort.SessionOptions()
    so.log_severity_level = 4  # failures are raised (and explained) as one-line errors
    if not fallback:
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    so.add_provider_for_devices([htp_device()], opts.provider_options())
    return so


def first_line(exc: BaseException) -> str:
    """ORT errors run to pages: the first line (capped) is what a one-line error shows."""
    return str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__


def diagnose(onnx_path: Path, opts: QnnOptions, name: str | None = None) -> GraphPlacement:
    """Place `onnx_path` on the HTP *with* CPU fallback allowed and report every node's EP.

    This is the explanation path (doctor, and a failed compile): nothing is compiled to disk.
    """
    so = session_options(opts, fallback=True)
    so.log_severity_level = 0
    so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    with _captured_ort_log() as log:
        try:
            with _stdout_to_stderr():
                session = ort.InferenceSession(str(onnx_path), so)
        except Exception as exc:  # ORT raises its own Fail/InvalidGraph types
            raise NpuchatError(
                f"the QNN EP could not place {onnx_path.name}: {first_line(exc)}"
            ) from exc
        assigned = session.get_provider_graph_assignment_info()
        del session
    reasons: dict[str, str] = {}
    for msg in log:
        if "Validation FAILED" in msg:
            for m in _REASON.finditer(msg):
                reasons.setdefault(m["node"], _first_sentence(m["reason"]))
    total = npu = 0
    falls: list[Fallback] = []
    for sub in assigned:
        for node in sub.get_nodes():
            total += 1
            if sub.ep_name == QNN_EP:
                npu += 1
            else:
                why = reasons.get(node.name, f"not supported by the QNN EP (runs on {sub.ep_name})")
                falls.append(Fallback(node.name, node.op_type, why))
    return GraphPlacement(name or onnx_path.stem, total, npu, falls)


def _first_sentence(text: str) -> str:
    """QNN runs sentences together ("…by QNN EP.Node `x` will not…"): keep the first."""
    return re.split(r"(?<=\.)(?=[A-Z])|(?<=\.)\s", text.strip(), maxsplit=1)[0]


def describe_fallbacks(p: GraphPlacement, limit: int = 3) -> str:
    shown = "; ".join(f"{f.node} ({f.op_type}): {f.reason}" for f in p.fallbacks[:limit])
    more = f"; and {len(p.fallbacks) - limit} more" if len(p.fallbacks) > limit else ""
    return f"{len(p.fallbacks)} node(s) cannot run on the NPU: {shown}{more}"
