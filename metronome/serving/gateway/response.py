"""One answer a session streams to its client (``responses.py`` sends its events; ``ClientSession`` holds it)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


@dataclass(frozen=True)
class ResponseRequest:
    """What ``response.create`` asked of the next answer: its token cap (0: the session's) and modalities."""

    max_output_tokens: int = 0
    modalities: tuple[str, ...] | None = None


@dataclass
class Response:
    """One answer being streamed: its ids, its caps, and what it said so far (for the ``.done`` events)."""

    id: str
    item_id: str
    max_output_tokens: int = 0                 # 0: the worker's own cap
    modalities: tuple[str, ...] = ("audio",)
    text: list[str] = field(default_factory=list)
    transcript: list[str] = field(default_factory=list)
    output_tokens: int = 0
    audio: bool = False                        # audio deltas were sent

    @property
    def speaks(self) -> bool:
        return "audio" in self.modalities

    def item(self, status: str) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if status != "in_progress":
            content = [{"type": "output_audio", "transcript": "".join(self.transcript)} if self.speaks
                       else {"type": "output_text", "text": "".join(self.text)}]
        return {"id": self.item_id, "object": "realtime.item", "type": "message", "role": "assistant",
                "status": status, "content": content}

    def where(self) -> dict[str, Any]:
        return {"response_id": self.id, "item_id": self.item_id, "output_index": 0, "content_index": 0}
