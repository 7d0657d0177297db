"""The energy adapter: loudness-bucket tokens, carried partial frames, chat framing, turn/free-running modes."""

from __future__ import annotations

import numpy as np
import pytest

from metronome.audio.adapter import TickAudio
from metronome.audio.energy_tokens import EnergyTokenAdapter

RATE = 16000
FRAME = 1280  # 80 ms at 16 kHz


def tone(seconds: float, amplitude: float = 0.1, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(round(seconds * RATE))) / RATE
    return (amplitude * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def speech_like(seconds: float, seed: int = 0) -> np.ndarray:
    """Noise whose loudness wanders over the buckets, so that token sequences carry information."""
    rng = np.random.default_rng(seed)
    n = int(seconds * RATE)
    envelope = np.repeat(10 ** rng.uniform(-3.5, 0, size=n // 400 + 1), 400)[:n]
    return (rng.standard_normal(n) * envelope * 0.5).clip(-1, 1).astype(np.float32)


@pytest.fixture
def adapter(smollm2_tokenizer):
    return EnergyTokenAdapter(smollm2_tokenizer, max_input_tokens=256)


def digits(tok, ids) -> str:
    return "".join(tok.decode([i]) for i in ids)


def test_worked_example_from_the_docstring(adapter, smollm2_tokenizer):
    tok = smollm2_tokenizer
    digit_ids = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
    assert adapter.bucket_tokens.tolist() == digit_ids == list(range(32, 42))
    # 2 s of a 0.1-amplitude tone: 25 frames at -23 dBFS -> bucket 6; silence -> bucket 0; full scale -> 9.
    assert digits(tok, adapter.frame_tokens(tone(2.0).reshape(25, FRAME))) == "6" * 25
    assert digits(tok, adapter.frame_tokens(np.zeros((3, FRAME), np.float32))) == "000"
    assert digits(tok, adapter.frame_tokens(tone(0.08, amplitude=1.0).reshape(1, FRAME))) == "9"
    loudness = [adapter.frame_tokens(tone(0.08, amplitude=a).reshape(1, FRAME))[0] for a in np.geomspace(1e-4, 1, 30)]
    assert loudness == sorted(loudness) and len(set(loudness)) == 10  # monotonic, every bucket reachable
    # 25 frames (+1 the carry may complete) + user prefix/suffix + generation prompt + assistant suffix.
    assert adapter.input_tokens_per_tick(2000) == 26 + 3 + 2 + 4 + 2


def test_first_tick_puts_the_system_prompt_first_then_never_again(adapter, smollm2_tokenizer):
    tok = smollm2_tokenizer
    adapter.open_session("a", "free_running", "Be brief.")
    adapter.open_session("b", "free_running", "")
    first_a, first_b = adapter.prepare([TickAudio("a", tone(0.16), max_tokens=2),
                                        TickAudio("b", tone(0.16), max_tokens=2)])
    assert tok.decode(first_a.token_ids) == "<|im_start|>system\nBe brief.<|im_end|>\n66"
    assert tok.decode(first_b.token_ids).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    again, = adapter.prepare([TickAudio("a", tone(0.16), max_tokens=2)])
    assert tok.decode(again.token_ids) == "66"


def test_same_audio_gives_the_same_tokens(smollm2_tokenizer):
    audio = speech_like(2.0)
    runs = []
    for _ in range(2):
        adapter = EnergyTokenAdapter(smollm2_tokenizer)
        adapter.open_session("x", "free_running", "hi")
        adapter.open_session("y", "free_running", "hi")
        px, py = adapter.prepare([TickAudio("x", audio), TickAudio("y", audio)])
        assert px.token_ids == py.token_ids
        runs.append(px.token_ids)
    assert runs[0] == runs[1]
    assert len(set(runs[0][-25:])) > 3  # the loudness really varies


def test_partial_frames_are_carried_to_the_next_tick(adapter):
    audio = speech_like(2.0, seed=1)
    adapter.open_session("whole", "free_running", "")
    adapter.open_session("parts", "free_running", "")
    header = len(adapter.chat.header(""))
    whole, = adapter.prepare([TickAudio("whole", audio)])
    tokens = []
    cuts = [0, 1000, 1001, 4000, 9999, 20000, len(audio)]  # arbitrary, not frame aligned
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        p, = adapter.prepare([TickAudio("parts", audio[a:b])])
        tokens += (p.token_ids or [])[header if i == 0 else 0:]
        assert adapter.session_state("parts")["carry_samples"] == b % FRAME
    assert tokens == whole.token_ids[header:] and len(tokens) == 25
    adapter.close_session("parts")
    with pytest.raises(KeyError):
        adapter.session_state("parts")  # the carry is freed with the session


def test_turn_mode_decodes_only_during_a_response(adapter, smollm2_tokenizer):
    tok = smollm2_tokenizer
    adapter.open_session("t", "turn", "S")
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    p, = adapter.prepare([TickAudio("t", tone(0.16, amplitude=1.0), max_tokens=4)])
    assert p.max_new_tokens == 0 and p.stop_token_ids == (stop,)
    assert tok.decode(p.token_ids).endswith("<|im_start|>user\n99")
    p, = adapter.prepare([TickAudio("t", np.zeros(FRAME, np.float32), new_turn=True, max_tokens=4)])
    assert tok.decode(p.token_ids) == "0<|im_end|>\n<|im_start|>assistant\n" and p.max_new_tokens == 4
    answer = tok.encode(" Hi there!", add_special_tokens=False)
    assert adapter.on_output("t", answer[:2], False) == " Hi there"
    p, = adapter.prepare([TickAudio("t", max_tokens=4)])
    assert p.token_ids is None and p.max_new_tokens == 4  # the response goes on
    assert adapter.on_output("t", answer[2:] + [stop], True) == "!"
    p, = adapter.prepare([TickAudio("t", max_tokens=4)])
    assert tok.decode(p.token_ids) == "\n" and p.max_new_tokens == 0  # answer closed after its <|im_end|>
    p, = adapter.prepare([TickAudio("t", max_tokens=4)])
    assert p.token_ids is None and p.max_new_tokens == 0  # idle


def test_turn_mode_text_cancel_and_barge_in(adapter, smollm2_tokenizer):
    tok = smollm2_tokenizer
    adapter.open_session("t", "turn", "S")
    p, = adapter.prepare([TickAudio("t", text="What is 2+2?", max_tokens=3)])
    assert tok.decode(p.token_ids).endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert p.max_new_tokens == 3
    # Audio during the response is held, not mixed into the answer.
    p, = adapter.prepare([TickAudio("t", tone(0.16), max_tokens=3)])
    assert p.token_ids is None and p.max_new_tokens == 3
    assert adapter.session_state("t")["held_tokens"] == 2
    p, = adapter.prepare([TickAudio("t", cancel=True, max_tokens=3)])
    assert tok.decode(p.token_ids) == "<|im_end|>\n<|im_start|>user\n66" and p.max_new_tokens == 0
    # Barge-in: a new turn while answering closes the answer and answers the new speech.
    p, = adapter.prepare([TickAudio("t", new_turn=True, max_tokens=3)])
    assert tok.decode(p.token_ids) == "<|im_end|>\n<|im_start|>assistant\n" and p.max_new_tokens == 3
    p, = adapter.prepare([TickAudio("t", tone(0.08), new_turn=True, max_tokens=3)])
    assert tok.decode(p.token_ids) == "<|im_end|>\n<|im_start|>user\n6<|im_end|>\n<|im_start|>assistant\n"


def test_free_running_decodes_every_tick_and_takes_text_as_a_turn(adapter, smollm2_tokenizer):
    tok = smollm2_tokenizer
    adapter.open_session("f", "free_running", "S")
    for tick in (TickAudio("f", tone(0.08), max_tokens=5), TickAudio("f", max_tokens=5),
                 TickAudio("f", new_turn=True, cancel=True, max_tokens=5)):
        p, = adapter.prepare([tick])
        assert p.max_new_tokens == 5 and p.stop_token_ids == ()
    p, = adapter.prepare([TickAudio("f", tone(0.08), text="hi", max_tokens=5)])
    assert tok.decode(p.token_ids) == "6<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_refused_tick_leaves_the_session_as_it_was(adapter):
    adapter.open_session("s", "turn", "")
    adapter.prepare([TickAudio("s", tone(0.05))])  # 800 samples carried
    p, = adapter.prepare([TickAudio("s", tone(0.05), text="word " * 400)])
    assert "at most 256" in p.error
    assert adapter.session_state("s") == {"mode": "turn", "carry_samples": 800, "responding": False,
                                          "user_open": False, "held_tokens": 0, "detok_held": 0}
    p, = adapter.prepare([TickAudio("s", tone(0.05), text="short", max_tokens=2)])
    assert p.error is None and p.max_new_tokens == 2
    assert adapter.session_state("s")["carry_samples"] == 1600 - FRAME


def test_sessions_modes_and_errors(adapter):
    with pytest.raises(ValueError, match="not supported"):
        adapter.open_session("x", "karaoke", "")
    with pytest.raises(ValueError, match="at most 128"):
        adapter.open_session("x", "turn", "word " * 500)
    assert adapter.sessions == 0
    adapter.open_session("x", "", "")
    assert adapter.session_state("x")["mode"] == "turn"
    with pytest.raises(ValueError, match="already open"):
        adapter.open_session("x", "turn", "")
    ghost, ok = adapter.prepare([TickAudio("ghost"), TickAudio("x")])
    assert "not open" in ghost.error and ok.error is None
    assert adapter.on_output("ghost", [5], False) == ""
    adapter.close_session("x")
    adapter.close_session("x")  # idempotent
    assert adapter.sessions == 0
