"""Decoders of the interaction (omni) models; ``registry.py`` holds one record per model."""
