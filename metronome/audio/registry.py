"""The interaction adapters a worker can run, by name (kept free of heavy imports for the CLI)."""

# name -> "module:callable"; the callable takes an AdapterContext and returns the adapter. Imported
# only when chosen (the cascade loads Whisper, the omni adapters their audio encoders).
ADAPTERS = {
    "cascade": "metronome.audio.cascade:CascadeAdapter.from_context",
    "energy": "metronome.audio.energy_tokens:EnergyTokenAdapter.from_context",
    "qwen2_5_omni": "metronome.audio.omni.qwen2_5_omni:build_adapter",
    "qwen3_omni": "metronome.audio.omni.qwen3_omni:build_adapter",
    "minicpm_o": "metronome.audio.omni.minicpm_o:build_adapter",
    "moshi": "metronome.audio.omni.moshi:build_adapter",
}
