"""Rotary position embedding with the checkpoint's frequency scaling.

The rotation pairs dimension ``i`` with ``i + rotary_dim / 2`` ("rotate half"), the layout of
the Hugging Face checkpoints; GGUF q/k rows are reordered to it at load time.
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig, RopeScaling


def inverse_frequencies(
    rotary_dim: int, theta: float, scaling: RopeScaling, freq_factors: torch.Tensor | None = None
) -> tuple[torch.Tensor, float]:
    """Return ``(inv_freq [rotary_dim / 2] float32, attention_factor)``.

    Computed in float32 as the Hugging Face reference does, so that the rotations match it to
    the last bit rather than being more exact than the model was trained with.

    ``freq_factors`` (Llama 3.1 GGUF files carry them as ``rope_freqs.weight``) divide the
    frequencies and stand for the ``llama3`` scaling.
    """
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / theta**exponents
    attention_factor = 1.0
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.float()
    elif scaling.kind == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.kind == "llama3":
        old_len = scaling.original_max_position
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif scaling.kind == "yarn":
        def correction_dim(num_rotations: float) -> float:
            return rotary_dim * math.log(scaling.original_max_position / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(correction_dim(scaling.beta_fast)), 0)
        high = min(math.ceil(correction_dim(scaling.beta_slow)), rotary_dim - 1)
        if low == high:
            high += 0.001  # avoid a division by zero in the ramp
        ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolate = 1 - ramp
        inv_freq = inv_freq / scaling.factor * (1 - extrapolate) + inv_freq * extrapolate
        attention_factor = 0.1 * math.log(scaling.factor) + 1.0
    return inv_freq, attention_factor


class RotaryEmbedding:
    """Precomputed cos/sin tables for positions ``[0, max_position)``."""

    def __init__(self, config: ModelConfig, max_position: int, device: torch.device, dtype: torch.dtype,
                 freq_factors: torch.Tensor | None = None) -> None:
        self.rotary_dim = config.rotary_dim or config.head_dim
        inv_freq, attention_factor = inverse_frequencies(self.rotary_dim, config.rope_theta, config.rope_scaling, freq_factors)
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)  # [positions, rotary_dim / 2]
        angles = torch.cat([angles, angles], dim=-1)
        # cos, sin: [max_position, rotary_dim], in the compute dtype like the reference models.
        self.cos = (angles.cos() * attention_factor).to(device=device, dtype=dtype)
        self.sin = (angles.sin() * attention_factor).to(device=device, dtype=dtype)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [num_tokens, num_heads, head_dim]`` by ``positions [num_tokens]`` (int64)."""
        cos = self.cos[positions].unsqueeze(1)  # [num_tokens, 1, rotary_dim]
        sin = self.sin[positions].unsqueeze(1)
        rot = x[..., : self.rotary_dim]
        half = self.rotary_dim // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        out = rot * cos + rotated * sin
        if self.rotary_dim == x.shape[-1]:
            return out
        return torch.cat([out, x[..., self.rotary_dim:]], dim=-1)
