import torch

from metronome.models.rope import Rotary


def test_shifting_rotated_keys_equals_rotating_at_the_shifted_position():
    rope = Rotary(tuple((1.0 / 10000 ** (torch.arange(0, 64, 2) / 64)).tolist()), 1.0, "cpu")
    k = torch.randn(50, 3, 64)
    positions = torch.arange(1000, 1050)
    cos, sin = rope.cos_sin(positions)
    stored = rope.apply(k, cos, sin)
    cos2, sin2 = rope.cos_sin(positions - 768)
    torch.testing.assert_close(rope.shift(stored, -768), rope.apply(k, cos2, sin2), atol=2e-4, rtol=1e-4)


def test_shift_is_a_pure_rotation_even_with_attention_scaling():
    rope = Rotary((0.5, 0.1), attention_scaling=1.3, device="cpu")
    k = torch.randn(4, 1, 4)
    torch.testing.assert_close(rope.shift(k, 7).norm(dim=-1), k.norm(dim=-1))
