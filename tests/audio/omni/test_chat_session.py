"""The chat-turn machinery the omni adapters share (``chat_session.py``, ``thinker.py``), on fakes.

A tiny ``ChatSessionAdapter`` (typed text only) and a ``ThinkerAdapter`` over a fake front end (no encoder
weights: each clip "encodes" to rows holding its length) exercise the session registry, refusal of bad
input, the decode budget, barge-in and held audio with the real SmolLM2 chat template.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from metronome.audio.adapter import TickAudio
from metronome.audio.detokenize import IncrementalDetokenizer
from metronome.audio.omni.chat_session import ChatSession, ChatSessionAdapter, pcm_problem
from metronome.audio.omni.thinker import AudioMarkers, ThinkerAdapter, splice, splice_all
from metronome.audio.turns import answer_close

HIDDEN = 4
MARKERS = AudioMarkers(start=10, pad=11, end=12)


def embed(ids: torch.Tensor) -> torch.Tensor:
    """A fake decoder table: row = -(token id), so spliced audio rows (>= 0) are told apart."""
    return -ids.float()[:, None].repeat(1, HIDDEN)


class FakeFrontEnd:
    """Blocks of 100 samples, hop 10, one embedding per 20 samples; records every batch it encodes."""

    device = torch.device("cpu")
    sample_rate = 1000
    block_samples = 100
    tokens_per_block = 5

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def tokens(self, samples: int) -> int:
        return samples // 20

    def flush_samples(self, samples: int) -> int:
        return samples // 10 * 10

    def encode(self, clips: list[np.ndarray]) -> list[torch.Tensor]:
        self.batches.append([c.size for c in clips])
        return [torch.full((self.tokens(c.size), HIDDEN), float(c.size)) for c in clips]


class Tiny(ThinkerAdapter):
    name = "tiny"

    def __init__(self, tokenizer, **kwargs) -> None:
        options = dict(max_input_tokens=256, instruction="", system_prompt="", max_response_tokens=256,
                       max_pending_s=0.3, default_mode="free_running", stop_token_ids=None)
        super().__init__(tokenizer, FakeFrontEnd(), MARKERS, embed, **{**options, **kwargs})


class Echo(ChatSessionAdapter):
    """Typed text only: a tick's text becomes a user turn; "bad" is refused by the plan itself."""

    name = "echo"
    modes = ("turn", "free_running")
    sample_rate = 16000

    def __init__(self, tokenizer, max_input_tokens: int = 64) -> None:
        from metronome.audio.chat import ChatTemplate

        self._init_sessions(tokenizer, "turn", max_input_tokens)
        self.chat = ChatTemplate(tokenizer)
        self.max_response_tokens = 5
        self.stop_token_ids = (self.chat.assistant_suffix[0],)

    def _new_session(self, mode, instructions):
        return ChatSession(mode, [], IncrementalDetokenizer(self.tokenizer))

    def _plan(self, s, tick):
        if tick.text == "bad":
            return "bad text"
        tokens = s.take_prefix()
        if tick.text:
            tokens += self.chat.user_turn(tick.text)
            s.started = s.responding = True
            s.response_tokens = 0
        return tokens

    def _plan_tokens(self, plan):
        return len(plan)

    def _realise(self, planned):
        return [(plan or None, None) for _, plan in planned]

    def _close_after(self, token_ids):
        return answer_close(self.chat, token_ids)

    def input_tokens_per_tick(self, budget_ms):
        return self.max_input_tokens


def test_pcm_problem():
    assert pcm_problem(np.zeros(0, np.float32)) is None and pcm_problem([0.1, -0.2]) is None
    assert "1-D" in pcm_problem(np.zeros((2, 3), np.float32))
    assert "NaN" in pcm_problem(np.array([0.0, np.inf], np.float32))


def test_splice_puts_encoder_rows_at_the_pads_in_order():
    rows = [torch.ones(2, HIDDEN), 2 * torch.ones(1, HIDDEN)]
    out = splice(embed, [5, 11, 11, 6, 11], pad=11, audio=rows, device="cpu")
    assert out[:, 0].tolist() == [-5.0, 1.0, 1.0, -6.0, 2.0]
    with pytest.raises(RuntimeError, match="placeholders"):
        splice(embed, [5, 11], pad=11, audio=rows, device="cpu")


def test_splice_all_gives_each_prompt_what_splice_gives_it():
    prompts = [[5, 11, 11, 6], [7], [11, 8, 11, 11]]
    audio = [[torch.full((2, HIDDEN), 1.0)], [], [torch.full((1, HIDDEN), 2.0), torch.full((2, HIDDEN), 3.0)]]
    together = splice_all(embed, prompts, pad=11, audio=audio, device="cpu")
    for tokens, rows, out in zip(prompts, audio, together):
        assert torch.equal(out, splice(embed, tokens, pad=11, audio=rows, device="cpu"))
    assert together[2][:, 0].tolist() == [2.0, -8.0, 3.0, 3.0]
    with pytest.raises(RuntimeError, match=r"2 audio placeholders for 1 encoder outputs \(prompt 1\)"):
        splice_all(embed, [[11], [11, 11]], pad=11, audio=[[torch.ones(1, HIDDEN)], [torch.ones(1, HIDDEN)]],
                   device="cpu")
    with pytest.raises(ValueError, match="one list a prompt"):
        splice_all(embed, [[11], [11]], pad=11, audio=[[torch.ones(1, HIDDEN)]], device="cpu")


def test_sessions_are_refused_cleanly_and_left_unchanged(smollm2_tokenizer):
    adapter = Echo(smollm2_tokenizer, max_input_tokens=16)
    adapter.open_session("a", "", "")
    with pytest.raises(ValueError, match="already open"):
        adapter.open_session("a", "turn", "")
    with pytest.raises(ValueError, match="karaoke"):
        adapter.open_session("b", "karaoke", "")
    before = adapter.session_state("a")
    out = adapter.prepare([TickAudio("ghost"), TickAudio("a", pcm=np.full(4, np.nan, np.float32)),
                           TickAudio("a", text="bad"), TickAudio("a", text="word " * 40)])
    assert "not open" in out[0].error and "NaN" in out[1].error and out[2].error == "bad text"
    assert "at most 16" in out[3].error
    assert adapter.session_state("a") == before == {"mode": "turn", "started": False, "user_open": False,
                                                     "responding": False}
    adapter.close_session("a")
    adapter.close_session("a")
    assert adapter.sessions == 0


def test_turn_answers_are_capped_and_closed_on_the_next_tick(smollm2_tokenizer):
    tok = smollm2_tokenizer
    adapter = Echo(tok)
    chat = adapter.chat
    adapter.open_session("t", "turn", "")
    idle, = adapter.prepare([TickAudio("t", max_tokens=3)])
    assert idle.max_new_tokens == 0 and idle.token_ids is None
    first, = adapter.prepare([TickAudio("t", text="Hi", max_tokens=3)])
    assert first.token_ids == chat.user_turn("Hi") and first.max_new_tokens == 3 and not first.ends_response
    assert first.stop_token_ids == adapter.stop_token_ids
    said = tok.encode(" Hello there, my friend", add_special_tokens=False)[:3]
    assert len(said) == 3
    assert adapter.on_output("t", said, finished=False) == tok.decode(said)
    # Two of max_response_tokens=5 are left: this tick decodes them and ends the answer.
    second, = adapter.prepare([TickAudio("t", max_tokens=3)])
    assert (second.max_new_tokens, second.ends_response) == (2, True)
    stop = chat.assistant_suffix[0]
    adapter.on_output("t", [said[0], stop], finished=True)
    assert not adapter.session_state("t")["responding"]
    closed, = adapter.prepare([TickAudio("t", max_tokens=3)])
    assert closed.token_ids == chat.assistant_suffix[1:] and closed.max_new_tokens == 0


def test_thinker_free_running_waits_for_a_block_and_encodes_every_session_at_once(smollm2_tokenizer):
    adapter = Tiny(smollm2_tokenizer, instruction="Listen.")
    chat, frontend = adapter.chat, adapter.frontend
    for sid in ("a", "b"):
        adapter.open_session(sid, "", "")
    # 0.05 s: less than a block, so only the header goes in and nothing decodes.
    out = adapter.prepare([TickAudio("a", pcm=np.zeros(50, np.float32), max_tokens=4), TickAudio("b", max_tokens=4)])
    assert [p.token_ids for p in out] == [chat.header("")] * 2 and [p.max_new_tokens for p in out] == [0, 0]
    assert adapter.session_state("a")["pending_samples"] == 50 and frontend.batches == [[]]
    # A block for each: one encoder batch for both, the first user turn with the instruction after the audio.
    out = adapter.prepare([TickAudio("a", pcm=np.zeros(60, np.float32), max_tokens=4),
                           TickAudio("b", pcm=np.zeros(130, np.float32), max_tokens=4)])
    assert frontend.batches[-1] == [100, 100]
    clip = [MARKERS.start] + [MARKERS.pad] * 5 + [MARKERS.end]
    want = chat.user_prefix + clip + adapter.instruction + chat.user_suffix + chat.generation_prompt
    for p in out:
        assert p.token_ids is None and p.max_new_tokens == 4 and p.stop_token_ids == ()
        assert p.embeds[:, 0].tolist() == [100.0 if t == MARKERS.pad else -float(t) for t in want]
    assert [adapter.session_state(s)["pending_samples"] for s in "ab"] == [10, 30]
    # The user types: what the model said last is closed first.
    adapter.on_output("a", [42], finished=False)
    typed, = adapter.prepare([TickAudio("a", text="Stop.", max_tokens=4)])
    assert typed.token_ids == answer_close(chat, [42]) + chat.user_turn("Stop.")


def test_thinker_splices_each_sessions_own_audio_into_its_own_prompt(smollm2_tokenizer):
    """Sessions heard in one tick, between them one that only types: one encoder batch and one splice for the
    tick, and each heard prompt holds its own clip's rows (the fake encoder writes a clip's length in them)."""
    adapter = Tiny(smollm2_tokenizer)
    for sid in "abc":
        adapter.open_session(sid, "", "")
    for ticks in ([("a", 100), ("b", None), ("c", 200)], [("c", 100), ("b", None), ("a", 300)]):
        out = adapter.prepare([TickAudio(sid, text="Hi." if n is None else "",
                                         pcm=np.zeros(0 if n is None else n, np.float32), max_tokens=4)
                               for sid, n in ticks])
        assert adapter.frontend.batches[-1] == [n for _, n in ticks if n is not None]
        for (sid, n), p in zip(ticks, out):
            assert p.error is None and p.max_new_tokens == 4
            if n is None:
                assert p.embeds is None and p.token_ids
                continue
            values = p.embeds[:, 0].tolist()
            audio = [i for i, v in enumerate(values) if v >= 0]
            assert [values[i] for i in audio] == [float(n)] * (n // 20)
            assert audio == list(range(audio[0], audio[0] + n // 20))
            assert values[audio[0] - 1] == -MARKERS.start and values[audio[-1] + 1] == -MARKERS.end


def test_thinker_turn_mode_commit_holds_audio_while_answering_and_barges_in(smollm2_tokenizer):
    adapter = Tiny(smollm2_tokenizer, instruction="Listen.", default_mode="turn")
    chat = adapter.chat
    adapter.open_session("t", "", "")
    heard, = adapter.prepare([TickAudio("t", pcm=np.zeros(145, np.float32), max_tokens=4)])
    clip5 = [MARKERS.start] + [MARKERS.pad] * 5 + [MARKERS.end]
    assert heard.max_new_tokens == 0 and adapter.session_state("t")["user_open"]
    assert [-int(x) for x in heard.embeds[:, 0] if x < 0] == \
        [t for t in chat.header("") + chat.user_prefix + clip5 if t != MARKERS.pad]
    # Commit: the 45 pending samples hear as whole hops (40: two embeddings); 5 stay pending.
    commit, = adapter.prepare([TickAudio("t", new_turn=True, max_tokens=4)])
    clip2 = [MARKERS.start] + [MARKERS.pad] * 2 + [MARKERS.end]
    assert commit.embeds.shape[0] == len(clip2 + adapter.instruction + chat.user_suffix + chat.generation_prompt)
    assert commit.max_new_tokens == 4 and adapter.session_state("t")["pending_samples"] == 5
    # During the answer audio waits, bounded by max_pending_s (0.3 s = 300 samples, the oldest dropped).
    held, = adapter.prepare([TickAudio("t", pcm=np.zeros(400, np.float32), max_tokens=4)])
    assert held.num_tokens == 0 and held.max_new_tokens == 4
    assert adapter.session_state("t")["pending_samples"] == 300
    # Cancel ends the answer; the held audio opens the next user turn (no instruction after the first).
    cancel, = adapter.prepare([TickAudio("t", cancel=True, max_tokens=4)])
    assert cancel.max_new_tokens == 0 and not adapter.session_state("t")["responding"]
    want = chat.assistant_suffix + chat.user_prefix + [MARKERS.start] + [MARKERS.pad] * 15 + [MARKERS.end]
    assert cancel.embeds[:, 0].tolist() == [300.0 if t == MARKERS.pad else -float(t) for t in want]
    assert adapter.session_state("t")["pending_samples"] == 0
