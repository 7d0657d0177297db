"""A session's tick outputs as Realtime server events: the user's turn, the answer's lifecycle, cancel, usage."""

from __future__ import annotations

import base64
import json

from metronome.serving.gateway.client_session import ClientSession
from metronome.serving.gateway.handle import TickReport
from metronome.serving.gateway.response import ResponseRequest
from metronome.serving.gateway.responses import cancel_response, commit_turn, speech_events, tick_events
from metronome.serving.proto import worker_pb2 as pb

REPORT = TickReport(tick=1, latency_ms=5.0, drift_ms=0.0, deadline_met=True, batch=1)


class Sink:
    def __init__(self):
        self.sent: list[dict] = []

    def send(self, data: bytes) -> bool:
        self.sent.append(json.loads(data))
        return True

    def send_many(self, data: list[bytes]) -> bool:
        return all(self.send(d) for d in data)

    def close(self, code, reason):
        pass


def session() -> ClientSession:
    return ClientSession("s", "w", Sink(), max_buffered_audio_s=1.0, max_messages_per_s=50)


def tick(s: ClientSession, **fields) -> list[dict]:
    return [e for e in tick_events(s, pb.SessionOutput(sid="s", **fields), REPORT, 100.0)
            if e["type"] != "metronome.tick"]


def kinds(events):
    return [e["type"] for e in events]


def test_a_spoken_turn_and_its_answer_in_ga_events():
    s = session()
    assert kinds(tick(s, speech_started_ms=1000)) == ["input_audio_buffer.speech_started"]
    heard = tick(s, speech_stopped_ms=2400, transcript="What is the capital of France?", input_tokens=30,
                 tokens=[1, 2], text="The capital")
    assert kinds(heard) == [
        "input_audio_buffer.speech_stopped", "input_audio_buffer.committed", "conversation.item.added",
        "conversation.item.input_audio_transcription.delta", "conversation.item.input_audio_transcription.completed",
        "conversation.item.done",
        "response.created", "response.output_item.added", "conversation.item.added", "response.content_part.added",
        "response.output_text.delta"]
    user_item = heard[0]["item_id"]
    assert heard[0]["audio_end_ms"] == 2400
    assert all(e.get("item_id", user_item) == user_item for e in heard[:6])    # one id for the whole user turn
    assert heard[5]["item"]["id"] == user_item
    spoken = tick(s, tokens=[3, 4, 5], text=" is Paris.", finished=True, audio_pcm16=b"\x01\x00" * 10,
                  audio_sample_rate=24000, audio_transcript="The capital is Paris.")
    assert kinds(spoken) == [
        "response.output_text.delta", "response.output_audio.delta", "response.output_audio_transcript.delta",
        "response.output_text.done", "response.output_audio_transcript.done", "response.output_audio.done",
        "response.content_part.done", "response.output_item.done", "conversation.item.done", "response.done"]
    rid = heard[6]["response"]["id"]
    assert {e["response_id"] for e in spoken if "response_id" in e} == {rid}
    assert base64.b64decode(spoken[1]["delta"]) == b"\x01\x00" * 10
    by = {e["type"]: e for e in spoken}
    assert by["response.output_text.done"]["text"] == "The capital is Paris."
    assert by["response.output_audio_transcript.done"]["transcript"] == "The capital is Paris."
    done = by["response.done"]["response"]
    assert done["status"] == "completed" and done["id"] == rid
    assert done["usage"] == {"input_tokens": 30, "output_tokens": 5, "total_tokens": 35}
    assert done["output"][0]["content"] == [{"type": "output_audio", "transcript": "The capital is Paris."}]
    assert s.response is None and s.input_tokens == 0


def test_cancel_ends_the_answer_and_nothing_more_of_it_is_sent():
    s = session()
    tick(s, tokens=[1], text="Once", audio_pcm16=b"\x00\x00", audio_sample_rate=24000)
    ended = cancel_response(s)
    assert ended[-1]["type"] == "response.done" and ended[-1]["response"]["status"] == "cancelled"
    assert ended[-1]["response"]["status_details"]["reason"] == "client_cancelled"
    assert s.cancel                                             # the worker hears of it with the next tick
    # The tick already in flight still carries the old answer's output: dropped, no new response opened.
    assert tick(s, tokens=[2], text=" upon", audio_pcm16=b"\x00\x00", audio_sample_rate=24000) == []
    # The worker stopped the answer on the tick that carried the cancel; what follows is new.
    assert kinds(tick(s, cancelled=True)) == []
    assert kinds(tick(s, tokens=[9], text="Hi"))[0] == "response.created"
    assert cancel_response(session()) == []                     # nothing to cancel: nothing to end


def test_speech_sent_between_ticks_joins_the_open_answer_only():
    def ahead(s):
        return speech_events(s, pb.SessionOutput(sid="s", audio_pcm16=b"\x02\x00" * 4, audio_sample_rate=24000,
                                                 audio_transcript="Once upon a time."))

    s = session()
    assert ahead(s) == []                                       # no answer open: nothing to join
    tick(s, tokens=[1], text="Once")
    spoken = ahead(s)
    assert kinds(spoken) == ["response.output_audio.delta", "response.output_audio_transcript.delta"]
    assert base64.b64decode(spoken[0]["delta"]) == b"\x02\x00" * 4
    assert spoken[1]["delta"] == "Once upon a time." and spoken[0]["response_id"] == s.response.id
    cancel_response(s)
    assert ahead(s) == []                                       # cancelled: the client has its response.done


def test_an_answer_cut_at_its_cap_ends_incomplete_and_text_mode_sends_no_audio():
    s = session()
    s.next_response = ResponseRequest(2, ("text",))             # response.create's max_output_tokens and modalities
    assert s.answer_cap == 2
    events = tick(s, tokens=[1, 2], text="Once upon", finished=True, audio_pcm16=b"\x00\x00", audio_sample_rate=24000,
                  audio_transcript="Once upon")
    assert "response.output_audio.delta" not in kinds(events)
    done = events[-1]["response"]
    assert done["status"] == "incomplete" and done["status_details"]["reason"] == "max_output_tokens"
    assert done["output"][0]["content"] == [{"type": "output_text", "text": "Once upon"}]
    assert s.answer_cap == 0                                    # the next answer has the session's cap again


def test_a_turn_that_ends_while_the_next_begins_is_reported_in_order():
    s = session()
    tick(s, speech_started_ms=100)
    events = tick(s, speech_stopped_ms=900, speech_started_ms=1500)
    assert kinds(events)[0] == "input_audio_buffer.speech_stopped" and events[0]["audio_end_ms"] == 900
    started = next(e for e in events if e["type"] == "input_audio_buffer.speech_started")
    assert started["audio_start_ms"] == 1500 and started["item_id"] != events[0]["item_id"]


def test_every_server_event_gets_an_event_id():
    s = session()
    s.send_all(tick(s, tokens=[1], text="x"))
    ids = [e["event_id"] for e in s.conn.sent]
    assert all(ids) and len(set(ids)) == len(ids)


def test_without_server_vad_all_speech_up_to_the_commit_is_one_turn():
    s = session()
    s.turn_detection = None
    first = tick(s, speech_started_ms=100)[0]["item_id"]
    paused = tick(s, speech_stopped_ms=900)
    assert kinds(paused) == ["input_audio_buffer.speech_stopped"]     # a pause: not committed, no item yet
    assert tick(s, speech_started_ms=1500)[0]["item_id"] == first     # the same turn goes on
    heard = tick(s, speech_stopped_ms=2500, transcript="Hello there")  # the commit flushed it
    assert {e["item_id"] for e in heard if "item_id" in e} == {first}
    assert s.input_item_id is None                                     # the next turn gets a new item


def test_an_answer_the_worker_cut_because_the_user_spoke_ends_cancelled():
    s = session()
    tick(s, tokens=[1, 2], text="Once upon")
    cut = tick(s, speech_started_ms=900, cancelled=True, finished=True)
    assert kinds(cut)[0] == "input_audio_buffer.speech_started"
    done, = [e for e in cut if e["type"] == "response.done"]
    assert done["response"]["status"] == "cancelled"
    assert done["response"]["status_details"]["reason"] == "turn_detected"
    assert s.response is None and not tick(s)                  # nothing more of that answer


def test_a_client_cancel_with_a_new_message_leaves_the_next_answer_open():
    s = session()
    tick(s, tokens=[1], text="Once")
    cancel_response(s)
    after = tick(s, cancelled=True, tokens=[7], text="Sure")   # the worker's cancel tick already answers anew
    assert "response.created" in kinds(after) and "response.done" not in kinds(after)
    assert s.response is not None


def test_a_transcript_after_the_next_turn_began_goes_to_the_turn_it_says():
    s = session()
    first = tick(s, speech_started_ms=100)[0]["item_id"]
    assert tick(s, speech_stopped_ms=900)[0]["item_id"] == first        # committed; Whisper has it
    late = tick(s, speech_started_ms=1300, transcript="Hello there")     # the next turn began first
    second = late[0]["item_id"]
    assert second != first
    assert {e["item_id"] for e in late[1:] if "item_id" in e} == {first}
    assert next(e for e in late if e["type"] == "conversation.item.done")["item"]["id"] == first
    assert tick(s, speech_stopped_ms=2000, transcript="Again")[-1]["item"]["id"] == second


def test_without_server_vad_the_stop_a_commit_caused_belongs_to_the_committed_turn():
    s = session()
    s.turn_detection = None
    turn = tick(s, speech_started_ms=100)[0]["item_id"]
    committed = commit_turn(s)
    assert kinds(committed) == ["input_audio_buffer.committed", "conversation.item.added"]
    assert committed[0]["item_id"] == turn
    stop = tick(s, speech_stopped_ms=1800)                               # the front end's flush, a tick later
    assert kinds(stop) == ["input_audio_buffer.speech_stopped"] and stop[0]["item_id"] == turn
    after = tick(s, speech_started_ms=2100, transcript="Hello there")    # speaking again before the transcript
    assert after[0]["item_id"] != turn
    assert next(e for e in after if e["type"] == "conversation.item.done")["item"]["id"] == turn
