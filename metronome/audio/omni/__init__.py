"""Adapters of the interaction (omni) models: their audio encoders and prompt layouts."""
