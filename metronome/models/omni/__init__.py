"""Decoders of the interaction (omni) models, loaded from their checkpoints by ``models.loader``."""
