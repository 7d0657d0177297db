"""Per-client state at the gateway: bounded buffers and the slow-reader policy."""

from metronome.serving.gateway.client_session import ClientSession, TokenBucket
from metronome.serving.protocol import DEFAULT_SAMPLE_RATE, TurnDetectionConfig


class FakeConnection:
    """A transport whose send queue holds ``room`` events (the client stopped reading)."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.sent: list[bytes] = []
        self.closes: list[tuple[int, str]] = []

    def send(self, data: bytes) -> bool:
        if len(self.sent) >= self.room:
            return False
        self.sent.append(data)
        return True

    def send_many(self, data: list[bytes]) -> bool:
        return all(self.send(d) for d in data)

    def close(self, code: int, reason: str) -> None:
        self.closes.append((code, reason))


def make(conn=None, buffered_s=1.0):
    return ClientSession("s", "w", conn or FakeConnection(8), max_buffered_audio_s=buffered_s, max_messages_per_s=50)


def test_a_client_that_stops_reading_is_disconnected_not_buffered_forever():
    conn = FakeConnection(room=8)
    session = make(conn)
    for i in range(8):
        assert session.send({"type": "x", "i": i})
    assert not session.send({"type": "overflow"})
    assert session.closed and session.close_reason == "slow_consumer"
    assert conn.closes == [(1008, "slow_consumer")] and len(conn.sent) == 8
    assert not session.send({"type": "after close"})
    session.close("again")
    assert conn.closes == [(1008, "slow_consumer")]  # closed once


def test_ordinary_ends_close_with_1000_a_lost_worker_with_1012_and_a_gone_socket_is_not_closed_again():
    conn = FakeConnection(room=8)
    make(conn).close("idle_timeout")
    assert conn.closes == [(1000, "idle_timeout")]
    conn = FakeConnection(room=8)
    session = make(conn)
    session.close("worker_unavailable")   # service restart: clients may reconnect
    assert conn.closes == [(1012, "worker_unavailable")]
    other = FakeConnection(room=8)
    gone = make(other)
    gone.disconnected()
    assert gone.closed and gone.close_reason == "client_closed" and other.closes == []


def test_audio_waiting_for_a_tick_is_bounded():
    session = make(buffered_s=0.1)
    assert session.sample_rate == DEFAULT_SAMPLE_RATE == 24000   # the Realtime API's rate when the client names none
    limit = DEFAULT_SAMPLE_RATE // 10 * 2                       # 0.1 s of PCM16
    assert session.append_audio(b"\x00" * limit)
    assert not session.append_audio(b"\x00\x00")
    tick = session.take_tick_input()
    assert len(tick.audio_pcm16) == limit and not session.audio and session.audio_bytes == 0
    assert session.append_audio(b"\x01\x00") and session.append_audio(b"\x02\x00")
    assert session.take_tick_input().audio_pcm16 == b"\x01\x00\x02\x00"  # in order, joined


def test_token_bucket_allows_bursts_then_limits():
    bucket = TokenBucket(rate=10, burst=5)
    assert sum(bucket.take() for _ in range(20)) == 5


def test_the_wire_encoded_step_request_equals_the_protobuf_one():
    from metronome.serving.gateway.client_session import step_request_wire
    from metronome.serving.proto import worker_pb2 as pb

    # The encoder writes these fields by number: a change to the proto must show up here.
    assert [(f.name, f.number) for f in pb.SessionInput.DESCRIPTOR.fields] == [
        ("sid", 1), ("new_turn", 2), ("audio_pcm16", 3), ("sample_rate", 4), ("text", 5), ("cancel", 6),
        ("max_tokens", 7), ("clear_audio", 8), ("max_output_tokens", 9), ("turn_detection", 10)]
    assert [(f.name, f.number) for f in pb.StepRequest.DESCRIPTOR.fields] == [
        ("sessions", 1), ("tokens_per_tick", 2), ("tick", 3), ("speech_ahead", 4)]

    def sessions():
        a = make(buffered_s=30.0)                      # 1 MB of audio: multi-byte length varints
        for _ in range(40):
            a.append_audio(bytes(range(256)) * 100)
        b = make()                                     # nothing buffered: defaults only
        c = make()
        c.sid = "séance_ü"
        c.sample_rate = 48000
        c.texts += ["hällo ", "wörld"]
        c.new_turn = c.cancel = c.audio_discarded = True
        c.append_audio(b"\x01\x02")
        c.max_output_tokens = 300                      # a two-byte varint
        c.turn_detection, c.turn_detection_changed = None, True   # server VAD off
        a.turn_detection_changed = True                # the defaults, sent as set
        a.turn_detection = TurnDetectionConfig(threshold=0.25, prefix_padding_ms=0, silence_duration_ms=700,
                                               create_response=False)
        return [a, b, c]

    for tokens, tick, ahead in ((25, 1, False), (0, 0, True), (300, 2**40, False)):
        wire = step_request_wire([s.take_tick_wire() for s in sessions()], tokens, tick, speech_ahead=ahead)
        expected = pb.StepRequest(sessions=[s.take_tick_input() for s in sessions()], tokens_per_tick=tokens,
                                  tick=tick, speech_ahead=ahead)
        assert pb.StepRequest.FromString(wire) == expected
        assert expected.sessions[0].turn_detection.prefix_padding_ms == 0          # given, though zero
        assert expected.sessions[0].turn_detection.HasField("prefix_padding_ms")
        assert not expected.sessions[1].HasField("turn_detection")                # unchanged: not sent
        assert not expected.sessions[2].turn_detection.server_vad
    once = sessions()[2]
    once.take_tick_wire()
    assert not once.turn_detection_changed                                         # the worker is told once
    drained = sessions()[0]
    drained.take_tick_wire()
    assert not drained.audio and drained.audio_bytes == 0  # taken, as take_tick_input does


def test_streamed_pieces_carry_input_without_controls_and_still_count_against_the_tick_bounds():
    from metronome.serving.gateway.client_session import step_request_wire
    from metronome.serving.proto import worker_pb2 as pb

    s = make(buffered_s=0.01)
    s.sample_rate = 16000                             # 160 samples: 320 bytes of audio per tick
    s.max_text_bytes = 8
    assert s.take_stream_wire() is None               # nothing buffered: nothing to stream
    s.new_turn = s.cancel = True
    assert s.append_audio(b"\x01\x00" * 100) and s.append_text("hey")
    piece = pb.StepRequest.FromString(step_request_wire([s.take_stream_wire()], 0, 0, speech_ahead=True))
    assert piece == pb.StepRequest(sessions=[pb.SessionInput(sid="s", audio_pcm16=b"\x01\x00" * 100,
                                                             sample_rate=16000, text="hey")], speech_ahead=True)
    assert not s.append_audio(b"\x02\x00" * 61)       # 200 streamed + 122 > 320: the tick's bound holds
    assert s.append_audio(b"\x02\x00" * 60) and not s.append_text("123456") and s.append_text("12345")
    last = pb.StepRequest.FromString(step_request_wire([s.take_tick_wire()], 4, 9)).sessions[0]
    assert (last.audio_pcm16, last.text, last.new_turn, last.cancel) == (b"\x02\x00" * 60, "12345", True, True)
    assert s.append_audio(b"\x03\x00" * 160)          # a new tick: the whole bound again


def test_a_turn_detection_change_goes_with_the_next_streamed_piece_ahead_of_its_audio_and_once():
    """A worker that hears audio as it streams applies a piece's turn detection before the piece's audio, so the
    change travels with the first piece after it, not with the tick's last message."""
    from metronome.serving.gateway.client_session import step_request_wire
    from metronome.serving.proto import worker_pb2 as pb

    s = make()
    s.sample_rate = 16000
    s.turn_detection, s.turn_detection_changed = None, True   # session.update: server VAD off
    assert s.append_audio(b"\x01\x00" * 100)
    piece = pb.StepRequest.FromString(step_request_wire([s.take_stream_wire()], 0, 0)).sessions[0]
    assert piece.HasField("turn_detection") and not piece.turn_detection.server_vad
    assert piece.audio_pcm16 == b"\x01\x00" * 100 and not s.turn_detection_changed
    assert s.append_audio(b"\x02\x00" * 100)
    later = pb.StepRequest.FromString(step_request_wire([s.take_stream_wire()], 0, 0)).sessions[0]
    last = pb.StepRequest.FromString(step_request_wire([s.take_tick_wire()], 4, 1)).sessions[0]
    assert not later.HasField("turn_detection") and not last.HasField("turn_detection")


def test_a_clear_reaches_the_worker_even_when_no_audio_was_streamed_this_tick():
    """The worker's VAD may hold the start of an utterance from earlier ticks: every clear must say so."""
    session = make()
    assert session.append_audio(b"\x01\x00" * 160)
    session.take_tick_input()                       # that audio went with an earlier tick
    session.discard_audio()
    assert session.has_unsent_input
    cleared = session.take_tick_input()
    assert cleared.clear_audio and not cleared.audio_pcm16
    assert not session.take_tick_input().clear_audio   # said once


def test_a_clear_after_a_commit_in_the_same_tick_keeps_the_committed_audio():
    """commit, more audio, clear (one tick): the worker gets the committed audio and the commit, no clear."""
    session = make()
    before, after = b"\x01\x00" * 160, b"\x02\x00" * 160
    assert session.append_audio(before)
    session.commit()
    assert session.append_audio(after)
    session.discard_audio()
    tick = session.take_tick_input()
    assert tick.new_turn and not tick.clear_audio and tick.audio_pcm16 == before
    session.discard_audio()                          # a later tick's clear: whole again
    assert session.take_tick_input().clear_audio


def test_a_clear_lost_with_a_broken_stream_goes_again_with_the_last_message():
    from metronome.serving.gateway.client_session import step_request_wire
    from metronome.serving.proto import worker_pb2 as pb

    def entry(parts):
        return pb.StepRequest.FromString(step_request_wire([parts], 0, 0)).sessions[0]

    session = make()
    session.discard_audio()
    assert session.append_audio(b"\x01\x00" * 160)
    assert entry(session.take_stream_wire()).clear_audio
    session.forget_streamed(lost=True)               # the stream broke: the worker never saw that entry
    assert entry(session.take_tick_wire()).clear_audio
    assert not entry(session.take_tick_wire()).clear_audio
