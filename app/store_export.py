"""A conversation as Markdown (to read or share) or JSON (to process), for `export`."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from .store_records import Conversation, StoredMessage


def export_markdown(conv: Conversation, msgs: list[StoredMessage]) -> str:
    out = [f"# {conv.title or 'Untitled conversation'}", ""]
    out.append(f"*Created {conv.created_at:%Y-%m-%d %H:%M} UTC*")
    if conv.settings.system_prompt:
        out += ["", "**System:** " + conv.settings.system_prompt]
    for m in msgs:
        heading = {"user": "You", "assistant": "Assistant", "system": "System"}[m.role]
        if m.status != "complete":
            heading += f" ({m.status})"
        out += ["", f"## {heading}", "", m.content.rstrip()]
        if m.error:
            out += ["", f"> Error: {m.error}"]
    return "\n".join(out) + "\n"


def export_json(conv: Conversation, msgs: list[StoredMessage]) -> str:
    doc: dict[str, Any] = {
        "id": conv.id,
        "title": conv.title,
        "created_at": conv.created_at.isoformat(),
        "updated_at": conv.updated_at.isoformat(),
        "settings": asdict(conv.settings),
        "messages": [
            {
                "role": m.role,
                "content": m.content,
                "status": m.status,
                "created_at": m.created_at.isoformat(),
                "metrics": None if m.metrics is None else asdict(m.metrics),
                "error": m.error,
                "stop_reason": m.stop_reason,
            }
            for m in msgs
        ],
    }
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"
