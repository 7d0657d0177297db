"""The fill model lives in the package (the gateway shows it live); the experiments use it from there."""

from metronome.monitor.fill import fit_fill, live_time_to_wall, plateau, time_to_wall

__all__ = ["fit_fill", "live_time_to_wall", "plateau", "time_to_wall"]
