"""The rotary module that replaces a model's own: frequencies from a registered method, cos/sin out.

Interface (the one transformers' Llama/Mistral/Qwen2/Qwen3 rotary modules have):
``forward(x, position_ids) -> (cos, sin)``, each ``(batch, seq, rotary_dim)`` in ``x.dtype``,
laid out as ``cat(freqs, freqs)`` (rotate-half layout, not interleaved pairs) and multiplied by
the attention factor. ``x`` is only read for its dtype and device.

Numerics: the angle ``m * theta_i`` is formed in float32 after an exact range reduction
(see :func:`rope_angles`), so cos/sin stay accurate at positions of 100k and more, and the
frequencies stay float32 whatever dtype the model is cast to.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .methods import RopeMethod

logger = logging.getLogger(__name__)

# Positions are split as m = q * ANGLE_BLOCK + r. The float32 product r * theta_i stays below
# ANGLE_BLOCK radians (error ~1e-4), and q * theta_i is replaced by q * ((ANGLE_BLOCK * theta_i)
# mod 2 pi), with the phase computed in float64. Plain float32 `m * theta_i` is off by up to
# 0.008 rad at m = 131072, more than bfloat16's rounding of cos/sin.
ANGLE_BLOCK = 1024


def block_phase(inv_freq_f64: torch.Tensor) -> torch.Tensor:
    """``(ANGLE_BLOCK * theta_i) mod 2 pi`` in float64, the angle one block of positions adds."""
    return torch.remainder(inv_freq_f64.double() * ANGLE_BLOCK, 2 * math.pi)


def rope_angles(position_ids: torch.Tensor, inv_freq: torch.Tensor, phase: torch.Tensor) -> torch.Tensor:
    """Angles ``m * theta_i`` modulo 2 pi, float32, shape ``position_ids.shape + (rotary_dim // 2,)``.

    Exact identity: ``m * theta = q * (B * theta) + r * theta`` with ``m = q * B + r`` and ``q``
    an integer, so ``q * (B * theta mod 2 pi)`` gives the same cos/sin. For ``m < B`` this is
    exactly transformers' ``m.float() * inv_freq``.
    """
    positions = position_ids.long()
    blocks = torch.div(positions, ANGLE_BLOCK, rounding_mode="floor")
    within = positions - blocks * ANGLE_BLOCK
    return blocks[..., None].float() * phase + within[..., None].float() * inv_freq


@dataclass
class _Frequencies:
    """One set of frequencies: float64 master on CPU plus float32 copies per device."""

    inv_freq_f64: torch.Tensor
    attention_factor: float
    effective_length: int
    on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self.on_device:
            self.on_device[device] = (
                self.inv_freq_f64.to(device=device, dtype=torch.float32),
                block_phase(self.inv_freq_f64).to(device=device, dtype=torch.float32),
            )
        return self.on_device[device]


class ExtendedRotaryEmbedding(nn.Module):
    """Rotary position embedding with frequencies from a registered scaling method.

    Replaces a model's rotary module instance (kept in ``original_rotary`` for
    :func:`hf_rope_ext.unpatch_model`). Static methods compute their frequencies once.
    Length-dependent methods use the frequencies of the current length ``L = max(position_ids) + 1``,
    rounded up beyond the original context to one of ``steps_per_doubling`` geometric steps per
    doubling (``L0 * 2 ** (k / n)``); the output depends on the call's positions only, never
    on earlier calls. Keeping a KV cache consistent with these frequencies is the job of
    :mod:`hf_rope_ext.cache_consistency`.
    """

    def __init__(
        self,
        original: nn.Module,
        method: RopeMethod,
        params: dict[str, Any],
        rotary_dim: int,
        base: float,
        steps_per_doubling: int | None = None,
    ):
        super().__init__()
        # Kept out of the module tree: not moved twice, not re-initialised by `init_weights`,
        # no extra entries in `named_modules()`.
        self.__dict__["original_rotary"] = original
        self.method = method
        self.params = params
        self.rotary_dim = rotary_dim
        self.base = base
        self.steps_per_doubling = steps_per_doubling
        self.original_max_seq_len = int(params["original_max_position_embeddings"])
        self.config = getattr(original, "config", None)
        self.rope_type = method.name
        self._frequencies: dict[int | None, _Frequencies] = {}

        initial = self._frequencies_for_length(None)
        device = original.inv_freq.device
        inv_freq, phase = initial.tensors(torch.device("cpu"))
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.register_buffer("inv_freq_block_phase", phase.to(device), persistent=False)
        self.attention_scaling = initial.attention_factor
        self._current = initial

    # -- frequencies -------------------------------------------------------------------------

    def frequencies(self, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        """``(inv_freq float64, attention_factor)`` this module uses for a sequence of ``seq_len``."""
        freqs = self._frequencies_for_length(seq_len)
        return freqs.inv_freq_f64.clone(), freqs.attention_factor

    def effective_length(self, seq_len: int | None) -> int | None:
        """The length whose frequencies a sequence of ``seq_len`` tokens uses.

        None inside the original context (and for static methods): the frequencies do not
        depend on the length there. Beyond it, the smallest ``ceil(L0 * 2 ** (k / n))`` that
        is at least ``seq_len``, or ``seq_len`` itself when ``steps_per_doubling`` is None.
        """
        if not self.method.length_dependent or seq_len is None or seq_len <= self.original_max_seq_len:
            return None
        seq_len = int(seq_len)
        steps = self.steps_per_doubling
        if steps is None:
            return seq_len
        original = self.original_max_seq_len
        k = max(1, math.ceil(steps * math.log2(seq_len / original) - 1e-9))
        length = math.ceil(original * 2 ** (k / steps))
        while length < seq_len:  # guard against rounding in log2
            k += 1
            length = math.ceil(original * 2 ** (k / steps))
        return length

    def _frequencies_for_length(self, seq_len: int | None) -> _Frequencies:
        key = self.effective_length(seq_len)
        cached = self._frequencies.get(key)
        if cached is None:
            inv_freq, attention_factor = self.method.compute(self.rotary_dim, self.base, self.params, key)
            inv_freq = torch.as_tensor(inv_freq, dtype=torch.float64).detach().cpu()
            if inv_freq.shape != (self.rotary_dim // 2,):
                raise ValueError(
                    f"Method {self.method.name!r} returned inv_freq of shape {tuple(inv_freq.shape)}, "
                    f"expected ({self.rotary_dim // 2},)."
                )
            cached = _Frequencies(inv_freq, float(attention_factor), key or self.original_max_seq_len)
            if len(self._frequencies) >= 64:  # token-exact lengths visit many values; keep the newest
                self._frequencies.pop(next(iter(self._frequencies)))
            self._frequencies[key] = cached
        return cached

    def _apply(self, fn, recurse=True):
        # `model.to(torch.bfloat16)` would cast the frequency buffers: put float32 copies back,
        # recomputed from the float64 master on the buffers' new device.
        super()._apply(fn, recurse)
        device = self.inv_freq.device
        original = self.original_rotary
        if original.inv_freq.device != device:  # outside the module tree: move it along, keep its dtype
            for name, buffer in list(original.named_buffers(recurse=False)):
                setattr(original, name, buffer.to(device))
        if device.type != "meta":
            inv_freq, phase = self._current.tensors(device)
            self.inv_freq = inv_freq.clone()
            self.inv_freq_block_phase = phase.clone()
        return self

    # -- forward -----------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.method.length_dependent:
            # One host sync per forward, as in transformers' dynamic types.
            length = int(position_ids.max()) + 1
            if length <= self.original_max_seq_len:
                # Inside the original context the method is the original RoPE: use the original
                # module itself, so outputs are bitwise those of the unpatched model.
                self._current, self.attention_scaling = self._frequencies_for_length(None), 1.0
                return self.original_rotary(x, position_ids)
            freqs = self._frequencies_for_length(length)
            inv_freq, phase = freqs.tensors(x.device)
            attention_factor = freqs.attention_factor
            self._current, self.attention_scaling = freqs, attention_factor
        else:
            inv_freq = self.inv_freq.to(device=x.device, dtype=torch.float32)
            phase = self.inv_freq_block_phase.to(device=x.device, dtype=torch.float32)
            attention_factor = self.attention_scaling
        angles = rope_angles(position_ids.to(x.device), inv_freq, phase)
        emb = torch.cat((angles, angles), dim=-1)
        cos = emb.cos() * attention_factor
        sin = emb.sin() * attention_factor
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)

    def extra_repr(self) -> str:
        extra = f", steps_per_doubling={self.steps_per_doubling}" if self.method.length_dependent else ""
        return (
            f"method={self.method.name!r}, scale={self.params['factor']:g}, "
            f"original_max_position_embeddings={self.original_max_seq_len}, rotary_dim={self.rotary_dim}{extra}"
        )
