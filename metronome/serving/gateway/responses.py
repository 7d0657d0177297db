"""A tick's output for one session as Realtime server events: transcripts, response deltas, ``metronome.tick``."""

from __future__ import annotations

import base64
import uuid
from typing import Any

from metronome.serving.gateway.client_session import ClientSession
from metronome.serving.gateway.handle import TickReport
from metronome.serving.proto import worker_pb2 as pb


def tick_events(session: ClientSession, out: pb.SessionOutput, report: TickReport, budget_ms: float,
                error: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The events one session gets for one tick, in order (``error``: the session's failure event, first).

    Opens and closes the session's response as the output says (``session.response_id``)."""
    events: list[dict[str, Any]] = []
    if error is not None:
        events.append(error)
    if out.transcript:
        # Adapters report whole utterances (the cascade transcribes VAD-delimited utterances), so each
        # transcript is final: a delta with all of it, then `completed`. A user turn that arrives while
        # a response streams ends that response (barge-in; the adapter closed the answer already).
        item_id = f"item_{uuid.uuid4().hex[:16]}"
        events.append({"type": "conversation.item.input_audio_transcription.delta", "item_id": item_id,
                       "content_index": 0, "delta": out.transcript})
        events.append({"type": "conversation.item.input_audio_transcription.completed", "item_id": item_id,
                       "content_index": 0, "transcript": out.transcript})
        if session.response_id:
            events.append(finish_response(session, "completed" if session.mode == "free_running" else "cancelled"))
    if out.text or out.tokens:
        if session.response_id is None:
            events.append(start_response(session))
        events.append({"type": "response.output_text.delta", "response_id": session.response_id,
                       "item_id": f"item_{session.response_id}", "output_index": 0, "content_index": 0,
                       "delta": out.text})
    if out.audio_pcm16:
        if session.response_id is None:
            events.append(start_response(session))
        events.append({"type": "response.output_audio.delta", "response_id": session.response_id,
                       "item_id": f"item_{session.response_id}", "output_index": 0, "content_index": 0,
                       "delta": base64.b64encode(out.audio_pcm16).decode("ascii"),
                       "sample_rate": out.audio_sample_rate})
    if out.finished and session.response_id:
        events.append(finish_response(session, "completed"))
    events.append({"type": "metronome.tick", "tick": report.tick, "latency_ms": round(report.latency_ms, 3),
                   "budget_ms": budget_ms, "deadline_met": report.deadline_met,
                   "batch": report.batch, "drift_ms": round(report.drift_ms, 3), "preempted": out.preempted,
                   "engine_ms": round(report.engine_ms, 3), "frontend_ms": round(report.frontend_ms, 3),
                   "worker_ms": round(report.worker_ms, 3), "kv_blocks_used": report.kv_blocks_used,
                   "kv_blocks_total": report.kv_blocks_total,
                   "input_dbfs": round(out.input_dbfs, 1), "input_clipping": round(out.input_clipping, 4)})
    return events


def start_response(session: ClientSession) -> dict[str, Any]:
    rid = session.start_response()
    return {"type": "response.created", "response": {"id": rid, "object": "realtime.response",
                                                     "status": "in_progress"}}


def finish_response(session: ClientSession, status: str) -> dict[str, Any]:
    event = {"type": "response.done", "response": {"id": session.response_id, "object": "realtime.response",
                                                   "status": status}}
    session.response_id = None
    return event
