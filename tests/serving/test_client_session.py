"""Per-client state at the gateway: bounded buffers and the slow-reader policy."""

import asyncio

from metronome.serving.client_session import ClientSession, TokenBucket


def make(queue=8, buffered_s=1.0):
    return ClientSession("s", "w", max_buffered_audio_s=buffered_s, send_queue_events=queue, max_messages_per_s=50)


async def test_a_client_that_stops_reading_is_disconnected_not_buffered_forever():
    session = make(queue=8)
    for i in range(8):
        assert session.send({"type": "x", "i": i})
    assert not session.send({"type": "overflow"})
    assert session.closed and session.close_reason == "slow_consumer"
    assert session.outbox.qsize() <= 8
    # The writer sees the sentinel at the end and stops.
    drained = [session.outbox.get_nowait() for _ in range(session.outbox.qsize())]
    assert drained[-1] is None
    assert not session.send({"type": "after close"})


async def test_audio_waiting_for_a_tick_is_bounded():
    session = make(buffered_s=0.1)  # 0.1 s at 16 kHz = 3200 bytes
    assert session.append_audio(b"\x00" * 3200)
    assert not session.append_audio(b"\x00\x00")
    tick = session.take_tick_input()
    assert len(tick.audio_pcm16) == 3200 and not session.audio
    assert session.append_audio(b"\x00" * 2)


def test_token_bucket_allows_bursts_then_limits():
    bucket = TokenBucket(rate=10, burst=5)
    assert sum(bucket.take() for _ in range(20)) == 5
