"""The official ``openai`` SDK drives a voice turn against the gateway with only ``base_url`` and ``api_key`` set.

A real worker (cascade: Silero VAD, Whisper tiny.en, SmolLM2, speech out) and a real gateway on loopback;
the SDK's ``client.realtime.connect()`` sends the bundled spoken question as 24 kHz PCM16 without naming a
rate (the Realtime API's default) and reads the GA events back.
"""

from __future__ import annotations

import asyncio
import base64
import shutil
from importlib import resources

import numpy as np
import pytest
import pytest_asyncio
import soundfile
import soxr

from metronome.config import EngineConfig, GatewayConfig, KVPolicy
from metronome.serving.gateway import serve_gateway
from metronome.serving.worker import WorkerConfig, serve_worker

openai = pytest.importorskip("openai")
pytest.importorskip("websockets")

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

BUDGET_MS = 500.0
API_KEY = "sk-test-metronome"
RATE = 24000   # the Realtime API's PCM16 rate; the client never names it
CHUNK_MS = 20


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server():
    engine = EngineConfig(model="smollm2-135m", policy=KVPolicy(sinks=16, window=256, block_size=16), num_blocks=200)
    worker = await serve_worker(WorkerConfig(engine, adapter="cascade", budget_ms=BUDGET_MS, port=0))
    gateway = await serve_gateway(GatewayConfig(
        workers=(worker.address,), port=0, budget_ms=BUDGET_MS, tokens_per_tick=8, api_key=API_KEY))
    yield gateway
    await gateway.stop()
    await worker.stop()


def question_pcm16() -> bytes:
    """The bundled spoken question at 24 kHz PCM16, with the silence after it that ends the turn."""
    samples, rate = soundfile.read(str(resources.files("metronome.audio") / "samples" / "01_france.wav"),
                                   dtype="float32")
    speech = soxr.resample(samples, rate, RATE)
    audio = np.concatenate([np.zeros(RATE // 4, np.float32), speech, np.zeros(RATE, np.float32)])
    return (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()


async def send_paced(connection, pcm: bytes) -> None:
    step = RATE * 2 * CHUNK_MS // 1000
    loop = asyncio.get_running_loop()
    start = loop.time()
    for k, i in enumerate(range(0, len(pcm), step)):
        await connection.input_audio_buffer.append(audio=base64.b64encode(pcm[i:i + step]).decode())
        await asyncio.sleep(max(0.0, start + (k + 1) * CHUNK_MS / 1000 - loop.time()))


async def test_the_openai_sdk_drives_a_voice_turn(server):
    client = openai.AsyncOpenAI(base_url=f"http://{server.address}/v1", api_key=API_KEY)
    async with client.realtime.connect(model="metronome") as connection:
        seen: list = []

        async def read() -> None:
            async for event in connection:
                seen.append(event)
                if event.type in ("response.done", "error"):
                    return

        reader = asyncio.create_task(read())
        await send_paced(connection, question_pcm16())
        await asyncio.wait_for(reader, timeout=60)

    kinds = [e.type for e in seen]
    assert "error" not in kinds, [e for e in seen if e.type == "error"]
    assert kinds[0] == "session.created"
    assert seen[0].session.audio.input.format.rate == RATE          # the GA default, not named by the client
    started = next(e for e in seen if e.type == "input_audio_buffer.speech_started")
    stopped = next(e for e in seen if e.type == "input_audio_buffer.speech_stopped")
    assert started.item_id == stopped.item_id and 0 <= started.audio_start_ms < stopped.audio_end_ms
    heard = next(e for e in seen if e.type == "conversation.item.input_audio_transcription.completed")
    assert "france" in heard.transcript.lower() and heard.item_id == started.item_id, heard.transcript
    assert kinds.index("input_audio_buffer.speech_started") < kinds.index("input_audio_buffer.speech_stopped") \
        < kinds.index("response.created") < kinds.index("response.done")
    text = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
    assert "Paris" in text, text
    done = seen[-1]
    assert done.type == "response.done" and done.response.status == "completed"
    usage = done.response.usage
    assert usage.output_tokens > 0 and usage.input_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert next(e for e in seen if e.type == "response.output_text.done").text == text
    for kind in ("response.output_item.added", "response.content_part.added", "response.content_part.done",
                 "response.output_item.done"):
        assert kind in kinds, kind
    audio = [e for e in seen if e.type == "response.output_audio.delta"]
    if shutil.which("espeak-ng"):   # speech out (espeak-ng, or Piper with espeak-ng's phonemes) is on
        assert sum(len(base64.b64decode(e.delta)) for e in audio) > 0
        transcript = "".join(e.delta for e in seen if e.type == "response.output_audio_transcript.delta")
        assert "Paris" in transcript, transcript
        assert "response.output_audio.done" in kinds
        assert next(e for e in seen if e.type == "response.output_audio_transcript.done").transcript == transcript


async def test_manual_turns_answer_caps_and_cancel_through_the_sdk(server):
    """turn_detection null: only the commit ends the turn; response.create's max_output_tokens cuts the answer
    (``incomplete``); response.cancel ends an answer and nothing more of it arrives."""
    client = openai.AsyncOpenAI(base_url=f"http://{server.address}/v1", api_key=API_KEY)
    async with client.realtime.connect(model="metronome") as connection:
        seen: list = []

        async def until(predicate, timeout=60.0):
            async with asyncio.timeout(timeout):
                async for event in connection:
                    seen.append(event)
                    assert event.type != "error", event
                    if predicate(event):
                        return event

        await connection.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
        updated = await until(lambda e: e.type == "session.updated")
        assert updated.session.audio.input.turn_detection is None
        await send_paced(connection, question_pcm16())
        await until(lambda e: e.type == "input_audio_buffer.speech_stopped")   # the VAD hears the pause ...
        assert not [e for e in seen if e.type.startswith("conversation.item.input_audio_transcription")
                    or e.type == "response.created"]                          # ... but does not end the turn
        await connection.input_audio_buffer.commit()
        await connection.response.create(response={"max_output_tokens": 3})
        done = await until(lambda e: e.type == "response.done")
        heard = next(e for e in seen if e.type == "conversation.item.input_audio_transcription.completed")
        assert "france" in heard.transcript.lower(), heard.transcript
        assert done.response.status == "incomplete" and done.response.usage.output_tokens == 3

        await connection.conversation.item.create(item={"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Tell me a long story about a dragon and a knight."}]})
        await connection.response.create()
        created = await until(lambda e: e.type == "response.created")
        await connection.response.cancel()
        cancelled = await until(lambda e: e.type == "response.done")
        assert cancelled.response.id == created.response.id and cancelled.response.status == "cancelled"
        mark = len(seen)
        await until(lambda e: e.type == "metronome.tick" and len(seen) > mark + 3)   # a few ticks later
        later = [e for e in seen[mark:] if getattr(e, "response_id", None) == created.response.id]
        assert not later, [e.type for e in later]
