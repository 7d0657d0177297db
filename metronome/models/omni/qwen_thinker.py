"""The checkpoint layout Qwen2.5-Omni and Qwen3-Omni share: a *thinker* (audio tower + decoder) beside a
talker and a vocoder, or a thinker-only checkpoint.

    full     model_type "<family>",         config.json: thinker_config.text_config, tensors thinker.*
    thinker  model_type "<family>_thinker", config.json: text_config,                tensors without the prefix

>>> layout = ThinkerLayout("qwen2_5_omni", "Qwen2.5-Omni", speech_parts=("talker.", "token2wav."))
>>> layout.decoder_name("thinker.model.layers.0.self_attn.q_proj.weight"), layout.decoder_name("thinker.lm_head.weight")
('model.layers.0.self_attn.q_proj.weight', 'lm_head.weight')
>>> layout.decoder_name("thinker.audio_tower.conv1.weight"), layout.decoder_name("talker.model.norm.weight")
(None, None)
>>> layout.decoder_name("model.language_model.norm.weight")
'model.norm.weight'
"""

from __future__ import annotations

from dataclasses import dataclass

from metronome.errors import ModelLoadError

# Prefixes of the thinker's non-decoder parts (after the optional "thinker." prefix is removed).
_THINKER_OTHER_PARTS = ("audio_tower.", "visual.", "model.audio_tower.", "model.visual.")


@dataclass(frozen=True)
class ThinkerLayout:
    family: str                       # the full checkpoint's model_type
    title: str                        # the model's name, for errors
    speech_parts: tuple[str, ...]     # top-level prefixes of the talker and vocoder

    @property
    def model_types(self) -> tuple[str, str]:
        return self.family, f"{self.family}_thinker"

    def thinker_config(self, config: dict) -> dict:
        """The thinker's config of a full (``thinker_config``) or thinker-only checkpoint's ``config.json``."""
        model_type = config.get("model_type")
        if model_type == self.family:
            thinker = config.get("thinker_config")
            if not isinstance(thinker, dict):
                raise ModelLoadError(f"config.json of a {self.family} checkpoint has no thinker_config")
            return thinker
        if model_type == f"{self.family}_thinker":
            return config
        raise ModelLoadError(f"model_type {model_type!r} is not a {self.title} checkpoint; "
                             f"expected one of {self.model_types}")

    def decoder_name(self, stored: str) -> str | None:
        """A stored tensor name → the decoder's parameter name, or None for the other parts of the model."""
        if stored.startswith(self.speech_parts):
            return None
        name = stored.removeprefix("thinker.")
        if name.startswith(_THINKER_OTHER_PARTS):
            return None
        if name.startswith("model.language_model."):
            return "model." + name.removeprefix("model.language_model.")
        return name
