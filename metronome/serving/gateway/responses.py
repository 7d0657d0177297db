"""A tick's output for one session as Realtime server events: the user's turn, the answer's lifecycle, ``metronome.tick``.

The user's turn: ``input_audio_buffer.speech_started`` / ``speech_stopped`` where the worker's VAD heard
them, then (server VAD) ``input_audio_buffer.committed`` and ``conversation.item.added`` for the turn's item,
and once it is transcribed ``conversation.item.input_audio_transcription.delta`` / ``completed`` and
``conversation.item.done``, all with that item's id. The transcript comes at the tick Whisper finishes (beside
the worker's tick), possibly after the next turn's ``speech_started``: it goes to the turn committed last.

An answer (``Response``) opens on its first text or audio: ``response.created``, ``response.output_item.added``,
``conversation.item.added``, ``response.content_part.added``; then ``response.output_text.delta`` (the
model's text: always, also in audio mode), ``response.output_audio.delta`` and
``response.output_audio_transcript.delta`` (what the audio says); it closes with the ``.done`` of each
(text, audio, transcript, content part, output item, conversation item) and ``response.done`` with
``usage``. An answer cut by its ``max_output_tokens`` ends ``incomplete``; a cancel or the user speaking
over it ends it ``cancelled``, and nothing more of it is sent (``ClientSession.cancelling`` drops what the
worker produced before it heard the cancel).
"""

from __future__ import annotations

import base64
from typing import Any

from metronome.serving.gateway.client_session import ClientSession
from metronome.serving.gateway.handle import TickReport
from metronome.serving.gateway.response import Response, ResponseRequest, new_id
from metronome.serving.proto import worker_pb2 as pb


def tick_events(session: ClientSession, out: pb.SessionOutput, report: TickReport, budget_ms: float,
                error: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The events one session gets for one tick, in order (``error``: the session's failure event, first)."""
    events: list[dict[str, Any]] = []
    if error is not None:
        events.append(error)
    if out.cancelled or out.error:
        session.cancelling = False   # this tick's output comes after the worker stopped the answer (or failed it)
    session.input_tokens += out.input_tokens
    user_turn_events(session, out, events)
    if not session.cancelling:
        answer_events(session, out, events)
    events.append({"type": "metronome.tick", "tick": report.tick, "latency_ms": round(report.latency_ms, 3),
                   "budget_ms": budget_ms, "deadline_met": report.deadline_met,
                   "batch": report.batch, "drift_ms": round(report.drift_ms, 3), "preempted": out.preempted,
                   "engine_ms": round(report.engine_ms, 3), "frontend_ms": round(report.frontend_ms, 3),
                   "worker_ms": round(report.worker_ms, 3), "kv_blocks_used": report.kv_blocks_used,
                   "kv_blocks_total": report.kv_blocks_total,
                   "input_dbfs": round(out.input_dbfs, 1), "input_clipping": round(out.input_clipping, 4)})
    return events


def user_turn_events(session: ClientSession, out: pb.SessionOutput, events: list[dict[str, Any]]) -> None:
    started = out.speech_started_ms if out.HasField("speech_started_ms") else None
    stopped = out.speech_stopped_ms if out.HasField("speech_stopped_ms") else None
    if stopped is not None and started is not None and started > stopped:   # a turn ended, the next began
        speech_stopped(session, stopped, events)
        stopped = None
    if started is not None:
        if session.turn_detection is not None or session.input_item_id is None:
            session.input_item_id = new_id("item")   # without server VAD all speech up to the commit is one turn
        events.append({"type": "input_audio_buffer.speech_started", "audio_start_ms": started,
                       "item_id": session.input_item_id})
    if stopped is not None:
        speech_stopped(session, stopped, events)
    if out.transcript:
        # Adapters report whole utterances (the cascade transcribes a turn once it ended), so each transcript
        # is final: a delta with all of it, then `completed`. A user turn that arrives while a response
        # streams ends that response (barge-in; the adapter closed the answer already).
        item_id = session.committed_item_id or session.input_item_id or new_id("item")
        if session.committed_item_id is None:
            session.input_item_id = None
        session.committed_item_id = None
        user_item = {"id": item_id, "object": "realtime.item", "type": "message", "role": "user",
                     "status": "completed", "content": [{"type": "input_audio", "transcript": out.transcript}]}
        events.append({"type": "conversation.item.input_audio_transcription.delta", "item_id": item_id,
                       "content_index": 0, "delta": out.transcript})
        events.append({"type": "conversation.item.input_audio_transcription.completed", "item_id": item_id,
                       "content_index": 0, "transcript": out.transcript})
        events.append({"type": "conversation.item.done", "item": user_item})
        if session.response is not None:
            events += finish_response(session, "completed" if session.mode == "free_running" else "cancelled",
                                      "turn_detected")


def speech_stopped(session: ClientSession, stopped_ms: int, events: list[dict[str, Any]]) -> None:
    # The stop a client's commit caused is heard after the commit (the VAD runs beside the tick): its turn's.
    late = session.input_item_id is None and session.committed_item_id is not None
    item_id = session.committed_item_id if late else (session.input_item_id or new_id("item"))
    events.append({"type": "input_audio_buffer.speech_stopped", "audio_end_ms": stopped_ms, "item_id": item_id})
    if session.turn_detection is None:
        session.input_item_id = None if late else item_id   # a pause; only the commit ends the turn
    elif late:
        events.append(user_item_added(item_id))   # committed by the client already; the VAD's stop adds the item
    else:   # the server's VAD ended the turn: it commits the buffer itself
        session.input_item_id, session.committed_item_id = None, item_id
        events.append({"type": "input_audio_buffer.committed", "item_id": item_id, "previous_item_id": None})
        events.append(user_item_added(item_id))


def commit_turn(session: ClientSession) -> list[dict[str, Any]]:
    """input_audio_buffer.commit: the events that answer it (``committed`` first). Without server VAD the commit
    ends the turn and adds its item; with it, the VAD's stop adds the item."""
    item_id = session.input_item_id or new_id("item")
    session.input_item_id, session.committed_item_id = None, item_id
    committed = {"type": "input_audio_buffer.committed", "item_id": item_id, "previous_item_id": None}
    return [committed] if session.turn_detection else [committed, user_item_added(item_id)]


def user_item_added(item_id: str) -> dict[str, Any]:
    """``conversation.item.added`` for a user's spoken turn that ended (its transcript comes with ``.done``)."""
    return {"type": "conversation.item.added", "previous_item_id": None, "item": {
        "id": item_id, "object": "realtime.item", "type": "message", "role": "user", "status": "in_progress",
        "content": [{"type": "input_audio", "transcript": None}]}}


def answer_events(session: ClientSession, out: pb.SessionOutput, events: list[dict[str, Any]]) -> None:
    if out.cancelled and session.response is not None:
        # The worker cut the answer the client still has open: the user spoke over it (barge-in). A client's own
        # cancel closed its answer when it was sent; output after it belongs to the next answer.
        events += finish_response(session, "cancelled", "turn_detected")
        return
    spoken = out.audio_pcm16
    if (out.text or out.tokens or spoken) and session.response is None:
        events += start_response(session)
    response = session.response
    if response is None:
        return
    response.output_tokens += len(out.tokens)
    if out.text:
        response.text.append(out.text)
        events.append({"type": "response.output_text.delta", **response.where(), "delta": out.text})
    if spoken and response.speaks:
        response.audio = True
        events.append({"type": "response.output_audio.delta", **response.where(),
                       "delta": base64.b64encode(spoken).decode("ascii"), "sample_rate": out.audio_sample_rate})
        if out.audio_transcript:
            response.transcript.append(out.audio_transcript)
            events.append({"type": "response.output_audio_transcript.delta", **response.where(),
                           "delta": out.audio_transcript})
    if out.finished:
        cut = response.max_output_tokens and response.output_tokens >= response.max_output_tokens
        events += finish_response(session, "incomplete" if cut else "completed", "max_output_tokens" if cut else None)


def speech_events(session: ClientSession, out: pb.SessionOutput) -> list[dict[str, Any]]:
    """Speech of the open answer that the worker sent between ticks; dropped while a cancel is on its way (the
    answer is closed for the client already)."""
    if session.response is None or session.cancelling:
        return []
    events: list[dict[str, Any]] = []
    answer_events(session, out, events)
    return events


def start_response(session: ClientSession) -> list[dict[str, Any]]:
    """Open the session's next answer, with the cap and modalities response.create asked for, if any."""
    asked = session.next_response or ResponseRequest()
    session.next_response = None
    response = session.response = Response(new_id("resp"), new_id("item"),
                                           asked.max_output_tokens or session.max_output_tokens,
                                           asked.modalities or session.output_modalities)
    part = {"type": "audio", "transcript": ""} if response.speaks else {"type": "text", "text": ""}
    item = response.item("in_progress")
    return [{"type": "response.created", "response": {
                "id": response.id, "object": "realtime.response", "status": "in_progress", "output": [],
                "output_modalities": list(response.modalities),
                "max_output_tokens": response.max_output_tokens or "inf"}},
            {"type": "response.output_item.added", "response_id": response.id, "output_index": 0, "item": item},
            {"type": "conversation.item.added", "previous_item_id": None, "item": item},
            {"type": "response.content_part.added", **response.where(), "part": part}]


def finish_response(session: ClientSession, status: str, reason: str | None = None) -> list[dict[str, Any]]:
    """Close the session's answer: each ``.done`` event, then ``response.done`` with usage."""
    response = session.response
    session.response = None
    text, transcript = "".join(response.text), "".join(response.transcript)
    events: list[dict[str, Any]] = [{"type": "response.output_text.done", **response.where(), "text": text}]
    if response.speaks:
        events.append({"type": "response.output_audio_transcript.done", **response.where(), "transcript": transcript})
        events.append({"type": "response.output_audio.done", **response.where()})
    part = {"type": "audio", "transcript": transcript} if response.speaks else {"type": "text", "text": text}
    item = response.item("completed" if status == "completed" else "incomplete")
    events += [{"type": "response.content_part.done", **response.where(), "part": part},
               {"type": "response.output_item.done", "response_id": response.id, "output_index": 0, "item": item},
               {"type": "conversation.item.done", "item": item}]
    usage = {"input_tokens": session.input_tokens, "output_tokens": response.output_tokens,
             "total_tokens": session.input_tokens + response.output_tokens}
    session.input_tokens = 0
    done = {"id": response.id, "object": "realtime.response", "status": status, "output": [item], "usage": usage,
            "output_modalities": list(response.modalities), "max_output_tokens": response.max_output_tokens or "inf"}
    if reason is not None:
        done["status_details"] = {"type": status, "reason": reason}
    events.append({"type": "response.done", "response": done})
    return events


def cancel_response(session: ClientSession) -> list[dict[str, Any]]:
    """response.cancel: the worker is told on the next tick; until it has, the answer's output is dropped."""
    session.cancel = True
    if session.response is None:
        return []
    session.cancelling = True
    return finish_response(session, "cancelled", "client_cancelled")
