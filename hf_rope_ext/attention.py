"""Attention-level context extension: remap relative positions inside attention, per model instance.

(Over 400 lines: the position remaps, the chunked attention kernel they need and its
per-instance install are one mechanism, tested together.)

Frequency scaling (linear, NTK, YaRN) changes the rotation of every position. The methods here
keep the trained rotations and instead choose, for each query ``i`` and key ``j``, positions
``(P_q, P_k)`` such that no relative distance ``P_q - P_k`` beyond the trained context ``L0``
ever reaches attention. Because RoPE rotations compose (``R(a) R(b) = R(a + b)``), a query or
key already rotated at its true position ``p`` is moved to position ``P`` by one more rotation
by ``P - p``: the KV cache keeps keys at their true positions, and each query's output depends
only on its own position and the keys before it, so generation with a cache equals a full
forward over the same tokens.

A method is a :class:`PositionRemap`: a few *regimes*, each with a query map, a key map and a
selector saying which ``(i, j)`` pairs use it (the selectors of one remap partition the causal
pairs). Logits of all regimes are merged before one softmax. Queries at positions below ``L0``
always use plain attention, so inputs inside the native context give exactly the original
model's outputs (the call is handed to the model's own attention function).

Memory: the queries are processed in chunks and each regime's keys in blocks; partial softmax
results are merged with their log-sum-exp, as flash attention does, so no ``T x T`` score
matrix is ever held (PyTorch's fused kernels that return the log-sum-exp compute each run of
blocks on CPU and CUDA; training and other devices use an explicit float32 computation).
Where a regime selects a band of distances and key positions (every regime of self-extend and
dual chunk, and plain attention) and positions are consecutive without padding, its keys split
into rectangles and causal triangles, so the fused kernels run every tile without a mask
(:func:`_add_band`).

Sliding windows and packed sequences read what transformers' path for the model's own
implementation reads: ``sdpa`` and ``eager`` masks carry both; flash attention's masks (None
or padding) carry neither, so its ``sliding_window`` argument narrows every regime, and packed
sequences (position ids restarting, or ``cu_seq_lens_q``) are computed one by one.

The model is switched to this attention by a per-instance entry in transformers'
``AttentionInterface`` / ``AttentionMaskInterface`` registries (the documented extension points):
a unique name is registered for each patched model, written to ``config._attn_implementation``,
and removed again by :func:`uninstall`.
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
import os
import re
import sys
import threading
import uuid
import weakref
from dataclasses import dataclass, field, fields, replace
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.weak import WeakTensorKeyDictionary

from .cache_log import FilledCaches
from .forward_threads import ForwardThreads
from .rotary import rope_angles

logger = logging.getLogger(__name__)

__all__ = [
    "Band", "DualChunkRemap", "PositionRemap", "Regime", "SelfExtendRemap", "remapped_attention",
    "remapped_attention_weights",
]

# Queries are processed QUERY_CHUNK at a time against keys in blocks of KEY_BLOCK: masks exist
# only for blocks a regime selects in part, so working memory stays O(QUERY_CHUNK x KEY_BLOCK)
# per such block whatever the length.
KEY_BLOCK = 512
QUERY_CHUNK = 512
# On CUDA the fused kernels hold no score matrix, and the cost is the number of kernel launches
# and host round trips per tile: larger query chunks, and masks built per run of blocks.
QUERY_CHUNK_CUDA = 4096
# Key blocks per masked call there: a mask's position temporaries (int64, query chunk x keys) stay
# near 256 MiB even when a padding mask leaves every block undecided (without padding, the
# remaps' regimes are bands and take no mask: see _add_band).
MASKED_RUN_BLOCKS = 16
# Set once a fused CUDA kernel refuses a call (see _partial_attention).
_FUSED_CUDA_FAILED = False
# Query chunks of the one-pass two-regime kernel (hf_rope_ext.fused_attention): it holds no
# score matrix at all, and the consecutive chunks of a call run in one launch (see
# _launch_two_regime), so chunks are cut only where the regimes change and at this size.
QUERY_CHUNK_TWO_REGIME = 16384
# Set once the two-regime kernel fails to compile or run (then the partial-softmax path runs).
_TWO_REGIME_FAILED = False
# HF_ROPE_EXT_TWO_REGIME_KERNEL=0 turns the kernel off (the partial-softmax path computes the same).
TWO_REGIME_SWITCH = "HF_ROPE_EXT_TWO_REGIME_KERNEL"


@dataclass(frozen=True)
class Regime:
    """One way of positioning a (query, key) pair.

    ``query_position(p)`` / ``key_position(p)`` map true positions (int64 tensors) to the
    positions used for the rotation; ``select(pq, pk)`` (broadcast ``(B, C, 1)`` against
    ``(B, 1, K)``) says which pairs use this regime. ``None`` maps mean "unchanged".
    ``classify(q_lo, q_hi, k_lo, k_hi)`` optionally says, from position ranges alone, whether a
    tile is selected nowhere (``SKIP``), everywhere (``FULL``) or in part (``PARTIAL``), so
    that only partial tiles need an elementwise mask. ``key_map`` names the key map: regimes of
    one remap with the same name share their rotated keys (default: the regime's own name).
    ``band(q_lo, q_hi)`` optionally says that for queries at positions in ``[q_lo, q_hi]`` the
    regime selects exactly the keys of a :class:`Band` (a range of distances and of key
    positions), or returns None where the selection is not one. On consecutive positions a band
    splits into unmasked rectangles and causal triangles, which the fused kernels run without
    any mask (see :func:`_add_band`).
    """

    name: str
    query_position: Callable[[torch.Tensor], torch.Tensor] | None
    key_position: Callable[[torch.Tensor], torch.Tensor] | None
    select: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    classify: Callable[[int, int, int, int], int] | None = None
    key_map: str | None = None
    band: Callable[[int, int], Band | None] | None = None

    @property
    def key_map_name(self) -> str:
        return self.key_map or self.name


SKIP, FULL, PARTIAL = 0, 1, 2


@dataclass(frozen=True)
class Band:
    """Keys at distances ``lo <= p_q - p_k <= hi`` and positions ``first_key <= p_k <= last_key``."""

    lo: int
    hi: float = math.inf
    first_key: int = 0
    last_key: float = math.inf


def _status(all_true: bool, none_true: bool) -> int:
    return FULL if all_true else SKIP if none_true else PARTIAL


def _both(first: int, second: int) -> int:
    """Status of the conjunction of two conditions."""
    if SKIP in (first, second):
        return SKIP
    return FULL if first == second == FULL else PARTIAL


class PositionRemap:
    """Base class: the regimes of one attention-level method, and the longest distance it uses."""

    original_length: int

    def regimes(self, max_position: int, inv_freq: torch.Tensor | None = None) -> list[Regime]:
        """The regimes needed for queries up to ``max_position`` (``inv_freq``: the model's float64
        frequencies, for remaps whose positions differ by dimension)."""
        raise NotImplementedError

    def max_distance(self, length: int) -> int:
        """Largest ``P_q - P_k`` the remap produces for sequences up to ``length`` tokens."""
        raise NotImplementedError

    def query_breaks(self, q_lo: int, q_hi: int) -> list[int]:
        """Query positions in ``(q_lo, q_hi]`` where the regime of every key can change (a query
        chunk that straddles one needs an elementwise mask on every key block, so chunks are cut there)."""
        return []


@dataclass(frozen=True)
class SelfExtendRemap(PositionRemap):
    """Self-Extend (Jin et al., ICML 2024, "LLM Maybe LongLM", arXiv 2401.01325).

    Neighbour attention keeps the true relative distance for keys within ``W`` tokens; farther
    keys use grouped positions (floor division by the group size ``G``), with the query shifted
    so that both regimes meet at distance ``W``:

        P_q = i,                            P_k = j          if i - j < W   (neighbour)
        P_q = floor(i / G) + W - floor(W / G),  P_k = floor(j / G)   otherwise  (grouped)

    The longest distance the query at ``i`` sees is ``floor(i / G) + W - floor(W / G)``, which
    must stay below ``L0``. With ``group_size=None`` each query takes the smallest ``G >= 2``
    that keeps it there, ``G(i)``, so nearby-enough far tokens are grouped as finely as the
    trained context allows, at any length (the paper fixes one ``G`` for the target length).
    Queries at ``i < L0`` use plain attention (all their distances were trained).

    ``far_positions="by-parts"`` replaces the floor grouping of far keys by YaRN's NTK-by-parts
    split (Peng et al., ICLR 2024, arXiv 2309.00071) applied to the far regime only: with
    ``kappa_i = gamma_i + (1 - gamma_i) / G`` (``gamma_i`` YaRN's ramp, 1 for dimensions turning
    more than ``beta_fast = 32`` times in ``L0``, 0 below ``beta_slow = 1``),

        P_q,i = kappa_i i + (1 - kappa_i) W,    P_k,i = kappa_i j    (dimension i, far keys)

    so the far distance in dimension ``i`` is ``W + kappa_i (d - W)``: fast dimensions keep the
    true distance (they turn many times within ``L0``, so every angle they produce was trained)
    and keep the order of nearby far tokens, which floor grouping merges; slow dimensions are
    divided by ``G`` and stay inside ``L0`` as the grouped positions do. Both regimes still meet
    at distance ``W``.
    """

    group_size: int | None
    neighbor_window: int
    original_length: int
    far_positions: str = "grouped"
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def keep_fraction(self, inv_freq: torch.Tensor, group: int) -> torch.Tensor:
        """``kappa_i`` of the ``"by-parts"`` far positions for group ``G`` (float64, one per frequency).

        YaRN's ramp over ``r_i = L0 theta_i / (2 pi)``, the turns dimension ``i`` makes in ``L0``:
        ``gamma_i = clamp((r_i - beta_slow) / (beta_fast - beta_slow), 0, 1)`` and
        ``kappa_i = gamma_i + (1 - gamma_i) / G``: fast dimensions keep their true positions,
        slow ones are divided by ``G`` as Self-Extend's groups are.
        """
        turns = self.original_length * inv_freq.to(torch.float64) / (2 * math.pi)
        gamma = ((turns - self.beta_slow) / (self.beta_fast - self.beta_slow)).clamp(0.0, 1.0)
        return gamma + (1.0 - gamma) / group

    def group_for(self, position: int) -> int:
        """``G`` of the query at ``position`` (the fixed group size, or the smallest that fits)."""
        if self.group_size is not None:
            return self.group_size
        W, L0 = self.neighbor_window, self.original_length
        # A G that fits has p // G + W - W // G > (p - W) / G + W - 1, so G > (p - W) / (L0 - W + 1):
        # no smaller one needs trying (a step at a time from 2 is quadratic in p / L0 over a forward).
        group = max(2, (position - W) // (L0 - W + 1))
        while position // group + W - W // group >= L0:
            group += 1
        return group

    def query_breaks(self, q_lo: int, q_hi: int) -> list[int]:
        # G(p) exceeds g from p = (L0 - W + floor(W / g)) g on (see group_for); L0: remapping starts
        W, L0 = self.neighbor_window, self.original_length
        breaks = [L0] if q_lo < L0 <= q_hi else []
        if self.group_size is None and q_hi >= L0:
            for group in range(self.group_for(max(q_lo, L0)), self.group_for(q_hi)):
                breaks.append((L0 - W + W // group) * group)
        return [b for b in breaks if q_lo < b <= q_hi]

    def _groups(self, positions: torch.Tensor) -> torch.Tensor:
        if self.group_size is not None:
            return torch.full_like(positions, self.group_size)
        # G(p) is non-decreasing in p: count the group sizes that are still too small
        last = int(positions.max())
        groups = torch.full_like(positions, 2)
        for group in range(2, self.group_for(max(last, 0))):
            too_small = torch.div(positions, group, rounding_mode="floor") + (self.neighbor_window - self.neighbor_window // group) >= self.original_length
            groups = torch.where(too_small & (groups == group), group + 1, groups)
        return groups

    def regimes(self, max_position: int, inv_freq: torch.Tensor | None = None) -> list[Regime]:
        W, L0 = self.neighbor_window, self.original_length
        if self.far_positions == "by-parts" and inv_freq is None:
            raise ValueError("self-extend with far_positions='by-parts' needs the model's frequencies.")

        def near(pq: torch.Tensor, pk: torch.Tensor) -> torch.Tensor:
            return (pq - pk < W) | (pq < L0)

        def near_status(q_lo: int, q_hi: int, k_lo: int, k_hi: int) -> int:
            return _status(q_hi < L0 or q_hi - k_lo < W, q_lo >= L0 and q_lo - k_hi >= W)

        def near_band(q_lo: int, q_hi: int) -> Band | None:
            return Band(0, W - 1) if q_lo >= L0 else Band(0) if q_hi < L0 else None

        def grouped(group: int) -> Regime:
            def select(pq: torch.Tensor, pk: torch.Tensor) -> torch.Tensor:
                return ~near(pq, pk) & (self._groups(pq) == group)

            def status(q_lo: int, q_hi: int, k_lo: int, k_hi: int) -> int:
                far = {FULL: SKIP, SKIP: FULL, PARTIAL: PARTIAL}[near_status(q_lo, q_hi, k_lo, k_hi)]
                lo, hi = self.group_for(max(q_lo, L0)), self.group_for(max(q_hi, L0))
                return _both(far, _status(lo == hi == group, group < lo or group > hi))

            def band(q_lo: int, q_hi: int) -> Band | None:
                inside = q_lo >= L0 and self.group_for(q_lo) == self.group_for(q_hi) == group
                return Band(W) if inside else None

            if self.far_positions == "by-parts":
                keep = self.keep_fraction(inv_freq, group)  # (rd/2,) float64

                # Per-dimension positions (..., rd/2): P_q,i = kappa_i p + (1 - kappa_i) W, P_k,i = kappa_i p.
                return Regime(
                    f"by-parts/{group}",
                    lambda p: p[..., None].to(torch.float64) * keep + (1.0 - keep) * W,
                    lambda p: p[..., None].to(torch.float64) * keep,
                    select,
                    status,
                    band=band,
                )
            return Regime(
                f"grouped/{group}",
                lambda p: torch.div(p, group, rounding_mode="floor") + (W - W // group),
                lambda p: torch.div(p, group, rounding_mode="floor"),
                select,
                status,
                band=band,
            )

        first = self.group_for(L0)
        last = self.group_for(max(max_position, L0))
        return [Regime("neighbor", None, None, near, near_status, band=near_band)] + [grouped(g) for g in range(first, last + 1)]

    def max_distance(self, length: int) -> int:
        last = length - 1
        G, W = self.group_for(last), self.neighbor_window
        return max(min(last, W - 1), last // G + W - W // G)


@dataclass(frozen=True)
class DualChunkRemap(PositionRemap):
    """Dual Chunk Attention (An et al., ICML 2024, arXiv 2402.17463; ChunkLlama).

    Positions are cut into chunks of ``s`` tokens; every key takes its position within its
    chunk, ``P_k = j mod s``. The query's position depends on where the key is (``c(p) =
    floor(p / s)`` the chunk index, ``w`` the local window):

        intra-chunk       c(j) = c(i):       P_q = i mod s            (true distance i - j)
        successive-chunk  c(j) = c(i) - 1:   P_q = min(i mod s + s, s + w)
        inter-chunk       c(j) < c(i) - 1:   P_q = s + w

    Distances stay below ``s + w`` (at most ``L0``) whatever the length; the first ``w`` tokens
    of a chunk see the previous chunk at their true distances (locality). Queries at
    ``i < L0`` use plain attention.
    """

    chunk_size: int
    local_window: int
    original_length: int

    def regimes(self, max_position: int, inv_freq: torch.Tensor | None = None) -> list[Regime]:
        s, w, L0 = self.chunk_size, self.local_window, self.original_length

        def chunk(p: torch.Tensor) -> torch.Tensor:
            return torch.div(p, s, rounding_mode="floor")

        def within(p: torch.Tensor) -> torch.Tensor:
            return torch.remainder(p, s)

        def far(pq: torch.Tensor) -> torch.Tensor:
            return pq >= L0

        def far_status(q_lo: int, q_hi: int) -> int:
            return _status(q_lo >= L0, q_hi < L0)

        def chunk_status(offset_lo: int, offset_hi: int):
            # Status of "c(pk) - c(pq) in [offset_lo, offset_hi]" over a tile.
            def status(q_lo: int, q_hi: int, k_lo: int, k_hi: int) -> int:
                lo, hi = k_lo // s - q_hi // s, k_hi // s - q_lo // s  # range of c(pk) - c(pq)
                return _both(far_status(q_lo, q_hi), _status(offset_lo <= lo and hi <= offset_hi, hi < offset_lo or lo > offset_hi))

            return status

        def chunk_band(offset_lo: int, offset_hi: int):
            # Queries of one chunk c beyond L0: keys of chunks c + offset_lo ... c + offset_hi.
            def band(q_lo: int, q_hi: int) -> Band | None:
                if q_lo < L0 or q_lo // s != q_hi // s:
                    return None
                return Band(0, math.inf, max(0, (q_lo // s + offset_lo) * s), (q_lo // s + offset_hi + 1) * s - 1)

            return band

        huge = 1 << 62
        return [
            Regime("native", None, None, lambda pq, pk: ~far(pq), lambda q_lo, q_hi, k_lo, k_hi: _status(q_hi < L0, q_lo >= L0),
                   band=lambda q_lo, q_hi: Band(0) if q_hi < L0 else None),
            Regime("intra", within, within, lambda pq, pk: far(pq) & (chunk(pk) == chunk(pq)), chunk_status(0, 0), "within",
                   chunk_band(0, 0)),
            Regime(
                "successive",
                lambda p: torch.clamp(within(p) + s, max=s + w),
                within,
                lambda pq, pk: far(pq) & (chunk(pk) == chunk(pq) - 1),
                chunk_status(-1, -1),
                "within",
                chunk_band(-1, -1),
            ),
            Regime(
                "inter",
                lambda p: torch.full_like(p, s + w),
                within,
                lambda pq, pk: far(pq) & (chunk(pk) < chunk(pq) - 1),
                chunk_status(-huge, -2),
                "within",
                chunk_band(-huge, -2),
            ),
        ]

    def query_breaks(self, q_lo: int, q_hi: int) -> list[int]:
        # L0 (remapping starts) and every chunk start beyond it: a query chunk inside one chunk
        # sees each key block in one regime, but the chunk's own diagonal block
        s, L0 = self.chunk_size, self.original_length
        first = max(q_lo + 1, L0)
        starts = range(-(-first // s) * s, q_hi + 1, s)
        return [b for b in sorted({L0, *starts}) if q_lo < b <= q_hi]

    def max_distance(self, length: int) -> int:
        return min(length - 1, self.chunk_size + self.local_window)


FAR_POSITIONS = ("grouped", "by-parts")


def _whole_number(value: Any, name: str, method: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__index__"):
        raise TypeError(f"{method}: {name} must be a whole number of tokens, got {value!r}.")
    if isinstance(value, float):
        if not value.is_integer():
            raise TypeError(f"{method}: {name} must be a whole number of tokens, got {value!r}.")
        value = int(value)
    return int(value)


def default_neighbor_window(original_length: int) -> int:
    """Self-Extend's default neighbour window: half the trained context.

    Measured on SmolLM2-135M (L0 = 8192), pg84, 16k tokens, perplexity beyond 8k with a group
    size per query: 30.04 with W = L0/2, 30.13 with W = L0/4 (yarn x2: 31.09); README, "Results:
    attention-level methods".
    """
    return max(1, original_length // 2)


def self_extend_remap(params: Mapping[str, Any], method: str = "self-extend") -> SelfExtendRemap:
    """The :class:`SelfExtendRemap` of resolved ``patch_model`` parameters, checked (errors name ``method``).

    ``neighbor_window`` defaults to :func:`default_neighbor_window`; ``group_size=None`` (the
    default) lets each query take the smallest group that keeps its distances below ``L0``.
    """
    original = int(params["original_max_position_embeddings"])
    if original < 2:  # no window 1 <= W < L0 exists
        raise ValueError(f"{method} needs an original context of at least 2 tokens (a neighbour window below it), "
                         f"got {original}; use a frequency method (yarn, dynamic-yarn).")
    target = int(math.ceil(original * params["factor"]))
    window = params.get("neighbor_window")
    window = default_neighbor_window(original) if window is None else _whole_number(window, "neighbor_window", method)
    if not 1 <= window < original:
        raise ValueError(
            f"{method}: neighbor_window must be between 1 and the original context minus 1 ({original - 1}), "
            f"got {window}; distances up to it keep their trained positions."
        )
    group = params.get("group_size")
    if group is not None:
        group = _whole_number(group, "group_size", method)
        if group < 2:
            raise ValueError(f"{method}: group_size must be at least 2 (1 would not group anything), got {group}.")
        if group > target:  # every far key is at position 0 from G = target on; larger ones overflow int64
            raise ValueError(
                f"{method}: group_size must be at most the extended context ({target} tokens), got {group}; from "
                f"{target} on every far token shares one position (or leave group_size unset: each query then takes "
                "the smallest that fits)."
            )
    far = params.get("far_positions", "grouped")
    if far not in FAR_POSITIONS:
        raise ValueError(f"{method}: far_positions must be one of {FAR_POSITIONS}, got {far!r}.")
    remap = SelfExtendRemap(group, window, original, far)
    if remap.max_distance(target) >= original:
        # the smallest G that fits the farthest query (a larger one may not: floor(i/G) - floor(W/G) is not monotone in G)
        needed = SelfExtendRemap(None, window, original, far).group_for(target - 1)
        raise ValueError(
            f"{method}: group_size={group} with neighbor_window={window} reaches distance "
            f"{remap.max_distance(target)} at {target} tokens, beyond the trained {original}; the smallest group_size "
            f"that fits is {needed}; or use a smaller neighbor_window (or leave group_size unset: each query then takes "
            "the smallest that fits)."
        )
    return remap


def dual_chunk_remap(params: Mapping[str, Any], method: str = "dual-chunk") -> DualChunkRemap:
    """The :class:`DualChunkRemap` of resolved ``patch_model`` parameters, checked (errors name ``method``).

    Defaults follow ChunkLlama: ``local_window = L0 // 16`` and ``chunk_size = 3 L0 // 4 - local_window``.
    """
    original = int(params["original_max_position_embeddings"])
    if original < 2:  # no chunk_size + local_window < L0 with chunk_size >= 1 exists
        raise ValueError(f"{method} needs an original context of at least 2 tokens (a chunk below it), got "
                         f"{original}; use a frequency method (yarn, dynamic-yarn).")
    window = params.get("local_window")
    window = original // 16 if window is None else _whole_number(window, "local_window", method)
    chunk = params.get("chunk_size")
    chunk = (3 * original) // 4 - window if chunk is None else _whole_number(chunk, "chunk_size", method)
    if window < 0:
        raise ValueError(f"{method}: local_window must be >= 0, got {window}.")
    if chunk < 1 or chunk + window >= original:
        raise ValueError(
            f"{method}: need 1 <= chunk_size and chunk_size + local_window < the original context {original}, "
            f"got chunk_size={chunk}, local_window={window}; the longest distance it produces is their sum."
        )
    return DualChunkRemap(chunk, window, original)


def logn_factor(positions: torch.Tensor, original_length: int) -> torch.Tensor:
    """Length-dependent attention temperature (Su 2021; Qwen's ``use_logn_attn``).

    The logits of the query at position ``i`` are multiplied by ``max(1, ln(i + 1) / ln(L0))``
    so the entropy of attention does not grow with the number of keys beyond the trained
    context. Per query position, so a KV cache stays exact.
    """
    scale = torch.log(positions.to(torch.float64) + 1) / math.log(original_length)
    return scale.clamp(min=1.0)


# ----------------------------------------------------------------------------------------------
# The computation
# ----------------------------------------------------------------------------------------------


def _rotation_table(shift: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` (B, 1, N, rd/2) float32 of rotating by ``shift`` (B, N), or (B, N, rd/2) per dimension.

    Angles from float64 frequencies, reduced modulo 2 pi (see :func:`hf_rope_ext.rotary.rope_angles`).
    """
    if shift.dim() == 3:  # a shift per dimension
        angles = torch.remainder(shift.to(torch.float64) * inv_freq, 2 * math.pi).to(torch.float32)[:, None]
    else:
        angles = rope_angles(shift, inv_freq)[:, None]
    return angles.cos(), angles.sin()


def _apply_rotation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, H, N, D; rotate-half layout) by the angles of ``cos``/``sin`` (B, 1, N, rd/2).

    Formed in float32 on the two halves (``[x1 cos - x2 sin, x2 cos + x1 sin]``, no full-width
    tables) and cast back once; dimensions past the rotary ones pass through.
    """
    half = cos.shape[-1]
    rotary_dim = 2 * half
    first, second = x[..., :half].float(), x[..., half:rotary_dim].float()
    rotated = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).to(x.dtype)
    if rotary_dim == x.shape[-1]:
        return rotated
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


def _rotate(x: torch.Tensor, shift: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, H, N, D) by ``shift`` (B, N) more positions (or (B, N, rd/2), per dimension)."""
    return _apply_rotation(x, *_rotation_table(shift, inv_freq))


@dataclass(frozen=True)
class _HostPositions:
    """The positions of one call, ``(B, N)`` on the device, with what tiling reads of them on the host."""

    query_positions: torch.Tensor
    key_positions: torch.Tensor
    query_host: torch.Tensor
    key_host: torch.Tensor
    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    key_bounds: list[tuple[int, int]]
    keys_sorted: bool
    first_row_sorted: bool  # the first row's query positions never decrease
    consecutive: bool  # p, p + 1, ... in every row alike, queries and keys

    @classmethod
    def of(cls, query_positions: torch.Tensor, key_positions: torch.Tensor) -> _HostPositions:
        # Tiles are classified from positions with integer work on the host: on a GPU, reading a
        # device tensor per tile would wait for the device thousands of times per layer.
        query_host, key_host = query_positions.detach().cpu().contiguous(), key_positions.detach().cpu().contiguous()
        return cls(
            query_positions, key_positions, query_host, key_host,
            int(query_host.min()), int(query_host.max()), int(key_host.min()), int(key_host.max()),
            _block_bounds(key_host, KEY_BLOCK), bool((key_host[:, 1:] >= key_host[:, :-1]).all()),
            bool((query_host[0, 1:] >= query_host[0, :-1]).all()), _consecutive(query_host) and _consecutive(key_host),
        )


def _version(tensor: torch.Tensor) -> int | None:
    """The in-place modification counter of ``tensor`` (None for inference tensors, which keep none)."""
    return None if tensor.is_inference() else tensor._version


def _reusable(stamp: tuple, known: tuple, within_forward: bool) -> bool:
    """Whether memo facts stamped ``known`` serve a call stamped ``stamp`` (same tensors assumed):
    only inside one forward of the patched model, whose hooks clear the memos around it, and with
    the same version counters. Layers called on their own recompute every time: a tensor can
    change without a version counter to show it (inference tensors, writes through ``.data`` or a
    shared numpy array)."""
    return within_forward and stamp == known


class KeyRotationTables:
    """The ``(cos, sin)`` tables of each key map for one set of key positions, and the host copy
    of the positions of the last call.

    Every decoder layer of a forward (or decode step) sees the same key positions, so one
    instance per patched model computes each key map's float64 angles once per forward instead
    of once per layer; a call with other key positions starts afresh, and so does a call outside
    ``torch.inference_mode`` after one inside it (inference tensors cannot be saved for backward).
    Layers that pass the very same position tensors (unmodified) reuse the host copy too: copying
    them to the host waits for the device, which would otherwise stop at every layer.
    """

    def __init__(self):
        self.positions: torch.Tensor | None = None
        self.tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.verified: torch.Tensor | None = None  # the positions last compared with self.positions
        self.last_call: tuple | None = None  # (query source, key source, stamp, _HostPositions)
        self.within_forward = False  # set by the patch's hooks around each forward of its model

    def positions_of_call(self, query_positions: torch.Tensor, key_positions: torch.Tensor, batch: int) -> _HostPositions:
        """``(B, N)`` views of the call's positions and their host facts, computed once for the same tensors."""
        stamp = (_version(query_positions), _version(key_positions), batch, torch.is_inference_mode_enabled())
        last = self.last_call
        if last is not None and last[0] is query_positions and last[1] is key_positions and _reusable(stamp, last[2], self.within_forward):
            return last[3]
        facts = _HostPositions.of(query_positions.expand(batch, -1), key_positions.expand(batch, -1))
        self.last_call = (query_positions, key_positions, stamp, facts)
        return facts

    def get(self, regime: Regime, positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions is not self.verified:  # the same tensor as the last check: nothing to compare
            known = self.positions
            stale = known is None or (known.is_inference() and not torch.is_inference_mode_enabled())
            if stale or known.shape != positions.shape or known.device != positions.device or not torch.equal(known, positions):
                self.positions, self.tables = positions.clone(), {}
            self.verified = positions
        name = regime.key_map_name
        if name not in self.tables:
            self.tables[name] = _rotation_table(_shift(regime.key_position, positions), inv_freq)
        return self.tables[name]

    def clear(self) -> None:
        self.positions, self.tables, self.verified, self.last_call = None, {}, None, None
        self.within_forward = False


def _shift(position_map: Callable[[torch.Tensor], torch.Tensor], positions: torch.Tensor) -> torch.Tensor:
    """How far ``position_map`` moves ``positions`` (B, N): (B, N), or (B, N, rd/2) for a map per dimension."""
    mapped = position_map(positions)
    if mapped.dim() == positions.dim() + 1:
        return mapped - positions[..., None].to(mapped.dtype)
    return mapped - positions


def _partial_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor | None,
    scaling: float,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over a subset of keys: ``(output (B, H, C, D), log-sum-exp (B, H, C) float32)``.

    ``key``/``value`` have ``Hkv`` heads, ``H`` a multiple of it (grouped-query attention: query
    head ``h`` reads key head ``h // (H / Hkv)``). ``allowed`` (B, 1, C, K) bool or None (all);
    ``causal`` (with ``allowed`` None and ``C == K``): row ``a`` reads keys ``0 ... a`` only.
    Rows with no allowed key get output 0 and log-sum-exp ``-inf``, so they drop out of the merge.

    Inference on CPU and CUDA uses PyTorch's fused kernels that return the log-sum-exp (the CPU
    flash kernel; on CUDA FlashAttention-2 for unmasked bf16/fp16 tiles, the memory-efficient
    kernel otherwise). Training, and any other device, use an explicit float32 computation: the
    fused kernels' backward ignores the gradient of the log-sum-exp, which the merge needs.
    """
    global _FUSED_CUDA_FAILED
    needs_grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    fused = not needs_grad and (query.device.type == "cpu" or (query.device.type == "cuda" and not _FUSED_CUDA_FAILED))
    if causal:
        if allowed is not None or query.shape[2] != key.shape[2]:
            raise ValueError("a causal tile takes no mask and as many keys as queries")
        if not fused:  # the explicit computation takes the triangle as a mask
            allowed = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device).tril()[None, None]
    output = None
    if fused:
        try:
            output, lse = _fused_partial_attention(query, key, value, allowed, scaling, causal)
        except RuntimeError as error:
            if query.device.type != "cuda":
                raise
            # A GPU or build without these kernels (or a shape they refuse): same result, slower.
            _FUSED_CUDA_FAILED = True
            logger.warning("Fused CUDA attention kernels unavailable (%s); using the explicit float32 "
                           "computation from now on.", str(error).splitlines()[0])
    if output is None:
        output, lse = _explicit_partial_attention(query, key, value, allowed, scaling)
    if allowed is not None:
        # unconditionally: asking whether any row is empty would wait for the device
        empty = ~allowed.any(dim=-1)  # (B, 1, C)
        lse = lse.masked_fill(empty, -math.inf)
        output = output.masked_fill(empty[..., None], 0.0)
    return output, lse


def _fused_partial_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor | None,
    scaling: float,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_partial_attention` through a fused kernel (CPU or CUDA, no gradient)."""
    batch, heads, rows, dim = query.shape
    repeat = heads // key.shape[1]
    on_cuda = query.device.type == "cuda"
    if causal:
        # the kernels' own triangle (square tiles: top-left and bottom-right alignment agree);
        # folding heads into rows would break it, so the tile's keys are copied per query head
        if repeat > 1:
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        output, lse = _unmasked_kernel(query, key, value, scaling, causal=True)
        return output, lse[..., :rows].float()
    if allowed is None:
        # the query heads of one key head become rows of one head: no copy of the keys
        folded = query.reshape(batch, heads // repeat, repeat * rows, dim)
        output, lse = _unmasked_kernel(folded, key, value, scaling, causal=False)
        lse = lse[..., : repeat * rows]  # the CUDA memory-efficient kernel pads its rows to a multiple of 32
        return output.reshape(batch, heads, rows, dim), lse.reshape(batch, heads, rows).float()
    # a masked tile: its keys are copied per query head (the mask cannot follow a fold)
    if repeat > 1:
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    if on_cuda:
        # The memory-efficient kernel wants the bias's last dimension 16-aligned: pad, then view.
        width = allowed.shape[-1]
        padded = torch.zeros((*allowed.shape[:-1], -(-width // 16) * 16), dtype=query.dtype, device=query.device)
        bias = padded[..., :width].masked_fill_(~allowed, -math.inf).expand(batch, heads, rows, width)
        output, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, True, 0.0, False, scale=scaling
        )[:2]
        lse = lse[..., :rows]
    else:
        bias = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device).masked_fill_(~allowed, -math.inf)
        output, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, False, attn_mask=bias, scale=scaling
        )[:2]
    return output, lse.float()


def _unmasked_kernel(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(output, log-sum-exp)`` of PyTorch's fused kernel for an unmasked or causal tile: the CPU
    flash kernel, FlashAttention-2 on CUDA for bf16/fp16, the memory-efficient kernel otherwise."""
    if query.device.type != "cuda":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, causal, attn_mask=None, scale=scaling
        )[:2]
    if query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] <= 256:
        return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, causal, False, scale=scaling)[:2]
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, None, True, 0.0, causal, scale=scaling
    )[:2]


def _explicit_partial_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor | None, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_partial_attention` computed explicitly in float32 (any device, differentiable)."""
    batch, heads, rows, dim = query.shape
    repeat = heads // key.shape[1]
    folded = query.float().reshape(batch, heads // repeat, repeat, rows, dim)
    scores = torch.matmul(folded, key.float()[:, :, None].transpose(-1, -2)) * scaling  # (B, Hkv, r, C, K)
    if allowed is not None:
        scores = scores.masked_fill(~allowed[:, :, None], -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])
    output = torch.matmul(weights, value.float()[:, :, None]).to(query.dtype)
    return output.reshape(batch, heads, rows, dim), lse.reshape(batch, heads, rows)


class _Accumulator:
    """Partial softmax results of one query chunk, merged by their log-sum-exp (flash attention's rescaling)."""

    def __init__(self):
        self.parts: list[tuple[torch.Tensor, torch.Tensor]] = []

    def add(self, output: torch.Tensor, lse: torch.Tensor) -> None:
        self.parts.append((output, lse))

    def result(self) -> torch.Tensor:
        return self.merged()[0]

    def merged(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The merged output and its log-sum-exp over all parts."""
        if len(self.parts) == 1:
            return self.parts[0]
        lses = torch.stack([lse for _, lse in self.parts])  # (P, B, H, C)
        total = torch.logsumexp(lses, dim=0)
        weights = torch.exp(lses - total.nan_to_num(neginf=0.0)).nan_to_num(nan=0.0)  # rows with no key: 0
        merged = self.parts[0][0].float() * weights[0][..., None]
        for (output, _), weight in zip(self.parts[1:], weights[1:]):
            merged.add_(output.float() * weight[..., None])
        return merged, total


def _runs(status: list[int]) -> list[tuple[int, int, int]]:
    """Group equal consecutive block statuses: ``[(status, first, last + 1), ...]``."""
    runs: list[tuple[int, int, int]] = []
    for index, value in enumerate(status):
        if runs and runs[-1][0] == value and runs[-1][2] == index:
            runs[-1] = (value, runs[-1][1], index + 1)
        else:
            runs.append((value, index, index + 1))
    return runs


def remapped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    allowed: Callable[[int, int], torch.Tensor | None],
    remap: PositionRemap | None,
    inv_freq: torch.Tensor,
    scaling: float,
    logn_length: int | None = None,
    query_chunk: int | None = None,
    key_rotations: KeyRotationTables | None = None,
    max_distance: int | None = None,
) -> torch.Tensor:
    """Attention with remapped relative positions; returns ``(B, C, H, D)`` like transformers' functions.

    Args:
        query: (B, H, Tq, D), rotated at the true positions; key/value: (B, Hkv, Tk, D), keys
            rotated at the true positions.
        query_positions: (B, Tq) int64 true positions; key_positions: (B, Tk).
        allowed: ``allowed(q_start, q_end)`` -> (B, 1, q_end - q_start, Tk) bool mask of the
            causal/padding structure for those queries, or None for "every key not after the
            query" (then judged from positions).
        remap: the position remap, or None for plain positions (logn only).
        inv_freq: float64 frequencies of the rotary embedding (for the extra rotations).
        scaling: the softmax scale (1 / sqrt(head_dim)).
        logn_length: if set, ``L0`` of the log-n attention temperature.
        key_rotations: tables kept across the layers of one forward (a model's patch holds one).
        max_distance: if set, a sliding window: only keys at most this many positions before the
            query (true positions) are read, on top of ``allowed``.
    """
    batch, heads, query_len, _ = query.shape
    if heads % key.shape[1]:
        raise ValueError(f"{heads} query heads cannot share {key.shape[1]} key heads evenly.")
    tables = key_rotations if key_rotations is not None else KeyRotationTables()
    facts = tables.positions_of_call(query_positions, key_positions, batch)
    query_positions, key_positions = facts.query_positions, facts.key_positions
    query_host, key_host, key_bounds, keys_sorted = facts.query_host, facts.key_host, facts.key_bounds, facts.keys_sorted
    q_lo, q_hi, k_lo, k_hi = facts.q_lo, facts.q_hi, facts.k_lo, facts.k_hi
    if inv_freq.device != query.device:  # the patch passes its copy on the device (one per forward)
        inv_freq = inv_freq.to(query.device)
    regimes = _call_regimes(remap, q_hi, k_lo, inv_freq, max_distance)
    # Only the regimes some pair of this call can use: a decode step beyond L0 needs its own
    # group's keys, not every group's (each would re-rotate the whole cache).
    regimes = [r for r in regimes if r.classify is None or r.classify(q_lo, q_hi, k_lo, k_hi) != SKIP]
    # Consecutive positions, the same in every row (no gaps, no padding): a regime that is a band
    # of distances needs no mask there (see _add_band).
    consecutive = facts.consecutive
    two_regime = consecutive and _two_regime_kernel_applies(query, key, value) and allowed(0, min(1, query_len)) is None
    by_map: dict[str, torch.Tensor] = {}  # regimes sharing a key map share its rotated keys (dual chunk's three)
    key_maps = list(dict.fromkeys(r.key_map_name for r in regimes if r.key_position is not None))
    # For the kernel, every key map is rotated into one tensor: one launch then reaches each
    # group's keys as a slice of it, with no copy (see fused_attention.two_regime_attention).
    stacked_keys = key.new_empty((len(key_maps), *key.shape)) if two_regime and len(key_maps) > 1 else None
    rotated_keys = []
    for regime in regimes:
        if regime.key_position is None:
            rotated_keys.append(key)
            continue
        if regime.key_map_name not in by_map:
            rotated = _apply_rotation(key, *tables.get(regime, key_positions, inv_freq))
            if stacked_keys is not None:
                rotated = stacked_keys[len(by_map)].copy_(rotated)
            by_map[regime.key_map_name] = rotated
        rotated_keys.append(by_map[regime.key_map_name])
    default_chunk = QUERY_CHUNK_CUDA if query.device.type == "cuda" else QUERY_CHUNK
    if two_regime:
        default_chunk = QUERY_CHUNK_TWO_REGIME
    chunk = max(1, min(query_len, query_chunk or default_chunk))
    starts = list(range(0, query_len, chunk))
    row = query_host[0]
    if remap is not None and query_len > 1 and facts.first_row_sorted:
        breaks = remap.query_breaks(q_lo, q_hi)
        cuts = torch.searchsorted(row, torch.tensor(breaks, dtype=row.dtype)).tolist() if breaks else []
        starts = sorted(set(starts).union(cut for cut in cuts if 0 < cut < query_len))
    outputs = []

    def tiles_output(q, pq, base, chunk_lo, chunk_hi, last_key):
        """One query chunk by the partial-softmax path: each regime's tiles or bands, merged."""
        tiles = _Tiles(chunk_lo, chunk_hi, last_key, key_bounds, key_host)
        accumulator = _Accumulator()
        for regime, keys in zip(regimes, rotated_keys):
            if regime.classify is not None and regime.classify(chunk_lo, chunk_hi, k_lo, k_hi) == SKIP:
                continue  # e.g. the groups of later queries
            qr = q if regime.query_position is None else _rotate(q, _shift(regime.query_position, pq), inv_freq)
            band = regime.band(chunk_lo, chunk_hi) if consecutive and base is None and regime.band is not None else None
            if band is not None:
                if band.lo <= band.hi:  # else the window leaves this regime no key for these queries
                    _add_band(accumulator, qr, keys, value, band, chunk_lo, k_lo, scaling)
            else:
                _add_regime(accumulator, regime, qr, keys, value, pq, key_positions, base, tiles, scaling)
        return accumulator.result().to(query.dtype)

    # Consecutive chunks that the two-regime kernel takes run in one launch (each with its own far
    # keys): one launch per chunk left the GPU idle at every launch's tail. Their rotated queries
    # are written into two tensors of the call's rows, which a launch reads a slice of.
    kernel_run: list[_KernelChunk] = []
    kernel_queries: list[torch.Tensor] = []  # (near, far), made at the first chunk the kernel takes

    def launch_kernel_run():
        if kernel_run:
            outputs.extend(_launch_two_regime(kernel_run, *kernel_queries, value, scaling, tiles_output))
            kernel_run.clear()

    for start, end in zip(starts, starts[1:] + [query_len]):
        q = query[:, :, start:end]
        pq = query_positions[:, start:end]
        if logn_length is not None:
            q = (q.float() * logn_factor(pq, logn_length).to(q.device, torch.float32)[:, None, :, None]).to(q.dtype)
        base = allowed(start, end)  # (B, 1, C, Tk) or None
        chunk_lo, chunk_hi = int(query_host[:, start:end].min()), int(query_host[:, start:end].max())
        # Keys after the chunk's last query are never visible (causal): stop there.
        if keys_sorted:
            last_key = int(torch.searchsorted(key_host, torch.full((batch, 1), chunk_hi), right=True).max())
        else:
            last_key = int((key_host <= chunk_hi).sum(dim=-1).max())
        tile_arguments = (q, pq, base, chunk_lo, chunk_hi, last_key)
        if two_regime and base is None:
            if not kernel_queries:
                kernel_queries.extend(torch.empty_like(query) for _ in range(2))
            kernel_chunk = _two_regime_chunk(q, pq, regimes, rotated_keys, chunk_lo, chunk_hi, k_lo, k_hi, inv_freq,
                                             tile_arguments, (start, end), kernel_queries)
            if kernel_chunk is not None:
                if kernel_run and not kernel_run[-1].continued_by(kernel_chunk):
                    launch_kernel_run()
                kernel_run.append(kernel_chunk)
                continue
        launch_kernel_run()
        outputs.append(tiles_output(*tile_arguments))
    launch_kernel_run()
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


def _two_regime_kernel_applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether a call may run :func:`hf_rope_ext.fused_attention.two_regime_attention`: inference on
    CUDA with Triton installed, a head size it takes, 64 queries or more (a decode step's few rows
    would leave most of the GPU idle: the tiles split its keys), the kernel not switched off."""
    from . import fused_attention

    if _TWO_REGIME_FAILED or not _two_regime_switched_on() or not fused_attention.available():
        return False
    if not _two_regime_device(query.device) or query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    needs_grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    return not needs_grad and query.shape[-1] in fused_attention.HEAD_DIMS and query.shape[2] >= 64


_SWITCH_VALUES = {"0": False, "false": False, "off": False, "no": False, "1": True, "true": True, "on": True, "yes": True}


def _two_regime_switched_on() -> bool:
    """``HF_ROPE_EXT_TWO_REGIME_KERNEL``: unset or 1/true/on/yes runs the kernel, 0/false/off/no not."""
    value = os.environ.get(TWO_REGIME_SWITCH)
    if value is None:
        return True
    switched = _SWITCH_VALUES.get(value.strip().lower())
    if switched is None:
        raise ValueError(f"{TWO_REGIME_SWITCH}={value!r} is not understood; set it to 0 (the kernel off) or 1 (on), "
                         "or unset it.")
    return switched


def _two_regime_device(device: torch.device) -> bool:
    """The kernel's device: CUDA (Triton's interpreter runs it on the CPU, far slower, for tests)."""
    return device.type == "cuda"


@dataclass
class _KernelChunk:
    """One query chunk as the two-regime kernel takes it (see :func:`_two_regime_chunk`)."""

    start: int  # its rows of the call, whose rotated queries are in the call's near/far tensors
    end: int
    near_keys: torch.Tensor
    far_keys: torch.Tensor
    first_distance: int  # P_q(first row) - P_k(first key)
    window: int
    max_distance: int | None
    tile_arguments: tuple  # the same chunk for the partial-softmax path, should the kernel fail

    def continued_by(self, other: _KernelChunk) -> bool:
        """Whether ``other`` continues this chunk in one launch: the next rows, the same near keys and bands."""
        return (other.start == self.end and other.near_keys is self.near_keys and other.window == self.window
                and other.max_distance == self.max_distance
                and other.first_distance == self.first_distance + self.end - self.start)


def _two_regime_chunk(q, pq, regimes, rotated_keys, chunk_lo, chunk_hi, k_lo, k_hi, inv_freq,
                      tile_arguments, rows, queries) -> _KernelChunk | None:
    """One query chunk prepared for the two-regime kernel, or None where its regimes are not two
    bands that meet (near: distances ``0 ... W - 1``, far: ``W ... max``, every key position).
    Its queries, rotated for each regime, are written into ``queries`` (near, far) at ``rows``.

    Self-Extend's chunks beyond ``L0`` are (one far group per chunk: chunks are cut where the
    group changes); dual chunk's bands are key ranges, and fall back to the tiles."""
    if _TWO_REGIME_FAILED:
        return None
    active = []
    for regime, keys in zip(regimes, rotated_keys):
        if regime.classify is not None and regime.classify(chunk_lo, chunk_hi, k_lo, k_hi) == SKIP:
            continue
        band = regime.band(chunk_lo, chunk_hi) if regime.band is not None else None
        if band is None or band.first_key > k_lo or band.last_key < k_hi:
            return None
        active.append((band, regime, keys))
    if len(active) != 2:
        return None
    (near_band, near, near_keys), (far_band, far, far_keys) = sorted(active, key=lambda item: item[0].lo)
    window = near_band.hi + 1
    if near_band.lo != 0 or far_band.lo != window or far_band.hi < window:
        return None
    if chunk_lo < k_lo:
        return None
    start, end = rows
    for regime, target in zip((near, far), queries):
        target[:, :, start:end] = q if regime.query_position is None else _rotate(q, _shift(regime.query_position, pq), inv_freq)
    return _KernelChunk(start, end, near_keys, far_keys, chunk_lo - k_lo, int(window),
                        None if far_band.hi == math.inf else int(far_band.hi), tile_arguments)


def _launch_two_regime(run: list[_KernelChunk], near_queries: torch.Tensor, far_queries: torch.Tensor,
                       value: torch.Tensor, scaling: float, tiles_output: Callable[..., torch.Tensor]) -> list[torch.Tensor]:
    """Consecutive kernel chunks in one launch of the two-regime kernel (each chunk's own far keys
    by ``far_rows``); ``[output]``, or the chunks by the partial-softmax path if the kernel fails."""
    global _TWO_REGIME_FAILED
    from . import fused_attention

    first, rows = run[0], slice(run[0].start, run[-1].end)
    far_keys: list[torch.Tensor] = []
    far_rows: list[int] = []
    for chunk in run:  # chunks cut by QUERY_CHUNK_TWO_REGIME alone share their group's keys
        if not far_keys or chunk.far_keys is not far_keys[-1]:
            far_keys.append(chunk.far_keys)
            far_rows.append(chunk.start - first.start)
    try:
        return [fused_attention.two_regime_attention(
            near_queries[:, :, rows], far_queries[:, :, rows], first.near_keys, far_keys, value,
            first_distance=first.first_distance, window=first.window, scaling=scaling, max_distance=first.max_distance,
            far_rows=far_rows,
        )]
    except torch.OutOfMemoryError:
        raise  # memory, as any other allocation of the forward: not a kernel that cannot run here
    except Exception as error:  # Triton's compile and launch errors have many types
        _TWO_REGIME_FAILED = True
        logger.warning("The two-regime attention kernel failed (%s: %s); using the partial-softmax path from now on.",
                       type(error).__name__, str(error).splitlines()[0] if str(error) else "")
        return [tiles_output(*chunk.tile_arguments) for chunk in run]


def _call_regimes(remap: PositionRemap | None, q_hi: int, k_lo: int, inv_freq: torch.Tensor,
                  max_distance: int | None) -> list[Regime]:
    """The regimes of one call: the remap's (plain attention without one), narrowed to a window."""
    if remap is not None:
        regimes = remap.regimes(q_hi, inv_freq)
    else:
        regimes = [Regime("plain", None, None, lambda pq, pk: pk <= pq, lambda q_lo, q_hi, k_lo, k_hi: FULL,
                          band=lambda q_lo, q_hi: Band(0))]
    if max_distance is not None and q_hi - k_lo > max_distance:  # the window cuts some pair
        regimes = [_within_distance(regime, max_distance) for regime in regimes]
    return regimes


def remapped_attention_weights(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    allowed: Callable[[int, int], torch.Tensor | None],
    remap: PositionRemap | None,
    inv_freq: torch.Tensor,
    scaling: float,
    logn_length: int | None = None,
    max_distance: int | None = None,
) -> torch.Tensor:
    """The softmax weights ``(B, H, Tq, Tk)`` that :func:`remapped_attention` applies (same
    arguments), built whole for ``output_attentions``: the ``T x T`` matrix eager attention
    returns too. Rows without any allowed key are 0."""
    batch, heads, query_len, _ = query.shape
    repeat = heads // key.shape[1]
    query_positions = query_positions.expand(batch, -1)
    key_positions = key_positions.expand(batch, -1)
    inv_freq = inv_freq.to(query.device)
    q_hi, k_lo = int(query_positions.max()), int(key_positions.min())
    q = query.float()
    if logn_length is not None:
        q = q * logn_factor(query_positions, logn_length).to(q.device, torch.float32)[:, None, :, None]
    base = allowed(0, query_len)
    scores = torch.full((batch, heads, query_len, key.shape[2]), -math.inf, device=query.device)
    for regime in _call_regimes(remap, q_hi, k_lo, inv_freq, max_distance):
        qr = q if regime.query_position is None else _rotate(q, _shift(regime.query_position, query_positions), inv_freq)
        kr = key.float() if regime.key_position is None else _rotate(key.float(), _shift(regime.key_position, key_positions), inv_freq)
        logits = torch.matmul(qr, kr.repeat_interleave(repeat, dim=1).transpose(-1, -2)) * scaling
        scores = torch.where(_regime_mask(regime, query_positions, key_positions, base), logits, scores)
    return scores.softmax(dim=-1).nan_to_num(0.0).to(query.dtype)


def _within_distance(regime: Regime, max_distance: int) -> Regime:
    """``regime`` restricted to pairs at most ``max_distance`` positions apart (a sliding window).

    Its band narrows to distances ``<= max_distance`` (``lo > hi`` where none is left), so
    windowed inputs keep the mask-free tiles."""

    def select(pq, pk):
        return regime.select(pq, pk) & (pq - pk <= max_distance)

    def classify(q_lo, q_hi, k_lo, k_hi):
        near = _status(q_hi - k_lo <= max_distance, q_lo - k_hi > max_distance)
        return _both(PARTIAL if regime.classify is None else regime.classify(q_lo, q_hi, k_lo, k_hi), near)

    def band(q_lo, q_hi):
        inner = regime.band(q_lo, q_hi)
        return None if inner is None else replace(inner, hi=min(inner.hi, max_distance))

    return replace(regime, select=select, classify=classify, band=None if regime.band is None else band,
                   key_map=regime.key_map_name)


@dataclass(frozen=True)
class _Tiles:
    """The key blocks one query chunk reads, with their position ranges as host integers."""

    q_lo: int
    q_hi: int
    last_key: int  # keys from here on come after every query of the chunk
    key_bounds: list[tuple[int, int]]  # (min, max) position of each whole block of KEY_BLOCK keys
    key_host: torch.Tensor  # (B, Tk) key positions on the host

    def blocks(self):
        """``(start, end, k_lo, k_hi)`` for each block of keys before ``last_key``."""
        for index, block_start in enumerate(range(0, self.last_key, KEY_BLOCK)):
            block_end = min(self.last_key, block_start + KEY_BLOCK)
            if block_end - block_start == KEY_BLOCK:
                k_lo, k_hi = self.key_bounds[index]
            else:  # a block cut by last_key: its own range
                part = self.key_host[:, block_start:block_end]
                k_lo, k_hi = int(part.min()), int(part.max())
            yield block_start, block_end, k_lo, k_hi


def _block_bounds(positions: torch.Tensor, size: int) -> list[tuple[int, int]]:
    """``(min, max)`` of host ``positions`` (B, N) over each whole block of ``size`` columns."""
    whole = positions.shape[-1] // size * size
    if not whole:
        return []
    blocks = positions[:, :whole].reshape(positions.shape[0], -1, size)
    return list(zip(blocks.amin(dim=(0, 2)).tolist(), blocks.amax(dim=(0, 2)).tolist()))


def _add_regime(
    accumulator: _Accumulator,
    regime: Regime,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    pq: torch.Tensor,
    pk: torch.Tensor,
    base: torch.Tensor | None,
    tiles: _Tiles,
    scaling: float,
) -> None:
    """Add one regime's keys, block by block, skipping blocks it does not select.

    On the CPU each block the positions leave undecided gets its mask, and a mask that turns out
    all true or all false makes the block full or skipped (unmasked tiles run faster). On CUDA
    that check would wait for the device once per block: undecided blocks keep one mask per run.
    """
    q_lo, q_hi, last_key = tiles.q_lo, tiles.q_hi, tiles.last_key
    refine = _refines_masks(query.device)
    statuses, masks = [], []
    for block_start, block_end, k_lo, k_hi in tiles.blocks():
        status = _status(k_hi <= q_lo, k_lo > q_hi)  # causal
        if regime.classify is not None:
            status = _both(status, regime.classify(q_lo, q_hi, k_lo, k_hi))
        else:
            status = _both(status, PARTIAL)
        if not refine:
            statuses.append(PARTIAL if status == FULL and base is not None else status)
            continue
        mask = None
        if status != SKIP and (status == PARTIAL or base is not None):
            mask = _regime_mask(regime, pq, pk[:, block_start:block_end], None if base is None else base[..., block_start:block_end])
            status = _status(bool(mask.all()), not bool(mask.any()))
            if status != PARTIAL:
                mask = None
        statuses.append(status)
        masks.append(mask)
    for status, first, stop in _runs(statuses):
        if status == SKIP:
            continue
        # unrefined masked runs in pieces, so that their int64 position temporaries stay small
        step = stop - first if status == FULL or refine else MASKED_RUN_BLOCKS
        for piece in range(first, stop, step):
            piece_stop = min(stop, piece + step)
            lo, hi = piece * KEY_BLOCK, min(last_key, piece_stop * KEY_BLOCK)
            if status == FULL:
                mask = None
            elif refine:
                mask = torch.cat(masks[piece:piece_stop], dim=-1)
            else:
                mask = _regime_mask(regime, pq, pk[:, lo:hi], None if base is None else base[..., lo:hi])
            output, lse = _partial_attention(query, key[:, :, lo:hi], value[:, :, lo:hi], mask, scaling)
            accumulator.add(output, lse)


def _consecutive(positions: torch.Tensor) -> bool:
    """Whether host ``positions`` (B, N) are ``p, p + 1, ...`` in every row alike."""
    row = positions[0]
    return bool((positions == row).all()) and bool((row[1:] - row[:-1] == 1).all())


def _add_band(
    accumulator: _Accumulator,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    band: Band,
    first_query: int,
    first_key: int,
    scaling: float,
) -> None:
    """Add a regime that selects the keys of ``band``: distances ``lo <= p_q - p_k <= hi``, key
    positions in ``[band.first_key, band.last_key]``.

    Query row ``a`` sits at position ``first_query + a`` and key column ``c`` at ``first_key + c``.
    For a run of ``n <= hi - lo`` rows starting at position ``s`` the band is three tiles:

        keys [s - hi, s - hi + n):      row a reads column c >= a    (a causal triangle, mirrored)
        keys [s - hi + n, s - lo):      every row reads every key    (a rectangle)
        keys [s - lo, s - lo + n):      row a reads column c <= a    (a causal triangle)

    (``hi`` infinite: the rectangle starts at the first key and there is no mirrored triangle.)
    Reversing the rows and columns of the first tile makes it a causal one, so every tile runs
    in the fused kernels without a mask; wider query chunks are cut into such runs. Each tile
    keeps the keys inside the band's positions that exist; a triangle cut there falls back to
    a mask.
    """
    lo, hi = band.lo, band.hi
    rows = query.shape[2]
    key_end = min(first_key + key.shape[2], band.last_key + 1)
    key_start = max(first_key, band.first_key)
    width = None if hi == math.inf else int(hi) - lo  # a band of one distance (width 0): one triangle
    runs = 1 if width is None else -(-rows // max(1, width))
    step = -(-rows // runs)  # runs of equal size: no sliver of a few rows left at the end
    outputs, lses = [], []
    for start in range(0, rows, step):
        count = min(step, rows - start)
        s = first_query + start
        q = query[:, :, start : start + count]
        tiles = [(s - lo, s - lo + count, "causal")]
        if width is None:
            tiles.append((first_key, s - lo, "all"))
        elif width > 0:
            tiles += [(s - lo - width + count, s - lo, "all"), (s - lo - width, s - lo - width + count, "mirrored")]
        # one run covers the whole chunk: its tiles go straight into the chunk's merge
        parts = accumulator if step == rows else _Accumulator()
        before = len(parts.parts)
        for tile_start, tile_stop, kind in tiles:
            begin, stop = max(tile_start, key_start), min(tile_stop, key_end)
            if begin >= stop:
                continue
            k, v = key[:, :, begin - first_key : stop - first_key], value[:, :, begin - first_key : stop - first_key]
            if kind == "all":
                parts.add(*_partial_attention(q, k, v, None, scaling))
            elif (begin, stop) != (tile_start, tile_stop):
                distance = torch.arange(s, s + count)[:, None] - torch.arange(begin, stop)[None]
                mask = ((distance >= lo) & (distance <= hi))[None, None].to(query.device)
                parts.add(*_partial_attention(q, k, v, mask, scaling))
            elif kind == "causal":
                parts.add(*_partial_attention(q, k, v, None, scaling, causal=True))
            else:
                output, lse = _partial_attention(q.flip(2), k.flip(2), v.flip(2), None, scaling, causal=True)
                parts.add(output.flip(2), lse.flip(-1))
        if len(parts.parts) == before:  # no key of the band exists for these rows
            parts.add(q.new_zeros(q.shape, dtype=torch.float32), torch.full(q.shape[:3], -math.inf, device=q.device))
        if parts is accumulator:
            return
        output, lse = parts.merged()
        outputs.append(output.float())
        lses.append(lse)
    accumulator.add(torch.cat(outputs, dim=2), torch.cat(lses, dim=-1))


def _refines_masks(device: torch.device) -> bool:
    """Whether undecided blocks are checked one by one (see :func:`_add_regime`)."""
    return device.type != "cuda"


def _regime_mask(regime: Regime, pq: torch.Tensor, pk: torch.Tensor, base: torch.Tensor | None) -> torch.Tensor:
    """``(B, 1, C, K)`` bool: the pairs of queries ``pq`` (B, C) and keys ``pk`` (B, K) that ``regime``
    selects and the causal/padding structure (``base``, or causality from positions) allows."""
    mask = regime.select(pq[:, :, None], pk[:, None, :])[:, None]
    if base is None:
        return mask & (pk[:, None, None, :] <= pq[:, None, :, None])
    return mask & base


# ----------------------------------------------------------------------------------------------
# Installing on a model instance
# ----------------------------------------------------------------------------------------------


@dataclass
class _Geometry:
    """Where the keys of a call sit in the cache, as transformers' mask creation computed it."""

    query_offset: int
    key_offset: int


@dataclass(frozen=True)
class _ForwardContext:
    """What one forward of the model decided for all its layers: whether the remap beyond the
    settle length applies (read from the rotary module's length) and the cache geometry of its calls."""

    beyond_settle: bool
    geometry: dict


@dataclass
class _PositionFacts:
    """What the layers read of one ``position_ids`` tensor: its largest position and the key
    positions derived from it (per cache geometry). One object per tensor, never changed to serve
    another (a forward run inside another, by a hook, keeps the outer one's)."""

    def __init__(self, source: torch.Tensor, stamp: tuple):
        self.source, self.stamp = source, stamp
        self.max_position = int(source.max())
        self.keys: dict[tuple[int, int, int], torch.Tensor] = {}
        self._out_of_order: dict[tuple[int, ...] | None, tuple[int, int] | None] = {}
        self._restarts: list[int] | None = None

    def restarts(self) -> list[int]:
        """Where the first row's positions equal its smallest: packed sequences start there (see
        :func:`_packed_bounds`). Read once for every layer: a copy to the host waits for the device."""
        if self._restarts is None:
            row = self.source[0].detach().cpu()
            self._restarts = torch.nonzero(row == row.min()).reshape(-1).tolist()
        return self._restarts

    def out_of_order(self, bounds: tuple[int, ...] | None = None) -> tuple[int, int] | None:
        """The first (row, token) whose position does not exceed the one before (None: every
        row's increase). A row packs sequences where :func:`_packed_bounds` cuts it: at ``bounds``
        (``cu_seq_lens_q``) if given, else, in a batch of one, where its positions restart at their
        smallest."""
        if bounds not in self._out_of_order:
            rows = self.source.detach().cpu()
            rises = rows[:, 1:] > rows[:, :-1]
            if bounds is not None:
                rises[:, [b - 1 for b in bounds if 0 < b < rows.shape[1]]] = True
            elif rows.shape[0] == 1:
                rises |= rows[:, 1:] == rows.min()
            wrong = (~rises).nonzero()  # row-major: the first row's first
            self._out_of_order[bounds] = (int(wrong[0, 0]), int(wrong[0, 1]) + 1) if len(wrong) else None
        return self._out_of_order[bounds]

    def key_positions(self, query_slot: int, key_offset: int, key_len: int) -> torch.Tensor:
        where = (query_slot, key_offset, key_len)
        if where not in self.keys:
            self.keys[where] = _key_positions(self.source, query_slot, key_offset, key_len)
        return self.keys[where]


@dataclass
class _PositionMemo:
    """The :class:`_PositionFacts` of the ``position_ids`` tensor every decoder layer of a forward receives.

    Its largest position and the key positions derived from it read device values (a wait for
    the device on a GPU, at every layer); they are computed once while the same tensor, unmodified,
    comes back. The tensor is held, so its identity cannot pass to another one."""

    current: _PositionFacts | None = None
    within_forward: bool = False  # set by the patch's hooks around each forward of its model

    def of(self, position_ids: torch.Tensor) -> _PositionFacts:
        stamp = (_version(position_ids), torch.is_inference_mode_enabled())
        facts = self.current
        if facts is None or position_ids is not facts.source or not _reusable(stamp, facts.stamp, self.within_forward):
            facts = self.current = _PositionFacts(position_ids, stamp)
        return facts

    def clear(self) -> None:
        self.current, self.within_forward = None, False


@dataclass
class AttentionPatch:
    """What :func:`install` changed on one model instance, and the state its functions share."""

    config: Any
    name: str
    original_implementation: str | None
    remap: PositionRemap | None
    inv_freq: torch.Tensor
    original_length: int
    logn: bool
    # Whether the remap is on in the current forward (None: always); a length-dependent method
    # with a settle length remaps only sequences longer than it, and shorter ones with
    # remap_below_settle (rotating with inv_freq_below_settle), if it has one.
    remap_applies: Callable[[], bool] | None = None
    remap_below_settle: PositionRemap | None = None
    inv_freq_below_settle: torch.Tensor | None = None
    geometry: dict[tuple[int, int], _Geometry] = field(default_factory=dict)
    key_rotations: KeyRotationTables = field(default_factory=KeyRotationTables)
    key_rotations_below_settle: KeyRotationTables = field(default_factory=KeyRotationTables)
    positions_memo: _PositionMemo = field(default_factory=_PositionMemo)
    warned_no_weights: bool = False
    warned_untrained_distance: bool = False
    # forwards of the patched model under way, per thread (a hook may run one inside another);
    # another thread's forward meanwhile is refused: the state above belongs to one forward
    forward_threads: ForwardThreads = field(default_factory=ForwardThreads)
    # The object whose ``current_length`` each forward of the model sets (the rotary module, read
    # by remap_applies), and its value saved as each forward started: a forward run inside another
    # (by a hook) would otherwise leave its own length to the outer one's remaining layers.
    forward_state: Any = None
    saved_lengths: list = field(default_factory=list)
    # the cache geometry of each enclosing forward (a forward run by a hook inside another)
    saved_geometries: list = field(default_factory=list)
    # The _ForwardContext of each forward with gradients, by the position_ids tensor of its own its
    # layers receive (weakly): gradient checkpointing recomputes a layer during backward with that
    # forward's arguments, after later forwards (an evaluation, another loss term) set the state.
    forward_contexts: WeakTensorKeyDictionary = field(default_factory=WeakTensorKeyDictionary)
    hooks: list = field(default_factory=list)  # the model's forward hooks (before_forward, after_forward)
    # the caches this patch filled, and where it left each (tokens, each row's last position)
    filled: FilledCaches = field(default_factory=FilledCaches)
    # inv_freq / inv_freq_below_settle on the devices the attention ran on, by device
    frequencies_on: dict = field(default_factory=dict)
    # The model whose forward this patch hooks (weakly: the model owns the patch), and the ids of its
    # modules as last read: another model reaches this patch's registry name only through a config
    # copied from this model's, and is refused (see _check_caller).
    hooked_model: weakref.ref | None = None
    own_module_ids: frozenset = frozenset()
    # ids of those modules' forward pre-hook tables: nn.DataParallel's replicas are shallow copies
    # that share them (``_replicate_for_data_parallel``), a model built from the config does not
    own_hook_tables: frozenset = frozenset()

    def __deepcopy__(self, memo: dict) -> AttentionPatch:
        # A copied model (copy.deepcopy, as TRL makes reference models) needs a patch and registry
        # entries of its own: under the original's name it would run the original's state, and
        # fail once the original is unpatched.
        copied = object.__new__(type(self))
        memo[id(self)] = copied
        # The copy starts with no forward under way: the original's count and per-forward state
        # (made while one of its forwards ran, or left by an interrupted one) are not the copy's.
        fresh = {"forward_threads": ForwardThreads(), "geometry": {}, "positions_memo": _PositionMemo(), "saved_lengths": [], "saved_geometries": [],
                 "forward_contexts": WeakTensorKeyDictionary(),
                 "frequencies_on": {}, "own_module_ids": frozenset(), "own_hook_tables": frozenset(),
                 # the copy's hooks are the copied model's (copied along, already in memo: hooks are
                 # copied from the model's attributes, before its submodules)
                 "hooked_model": _copied_reference(self.hooked_model, memo)}
        for item in fields(self):  # the caches the original filled are not the copy's (see FilledCaches)
            value = fresh[item.name] if item.name in fresh else copy.deepcopy(getattr(self, item.name), memo)
            setattr(copied, item.name, value)
        for tables in (copied.key_rotations, copied.key_rotations_below_settle):
            tables.last_call, tables.within_forward = None, False
        copied.name = _registry_name(self.original_implementation)
        _register(copied)
        if getattr(copied.config, "_attn_implementation", None) == self.name:
            copied.config._attn_implementation = copied.name
        return copied

    def remap_for(self, beyond_settle: bool) -> PositionRemap | None:
        """The remap used beyond a method's settle length (or always, without one), or below it."""
        return self.remap if beyond_settle else self.remap_below_settle

    def _frequencies_on(self, inv_freq: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``inv_freq`` (one of the patch's own) on ``device``, copied once: a copy to the GPU at
        every layer would wait there for the device each time."""
        if inv_freq.device == device:
            return inv_freq
        copies = self.frequencies_on.setdefault(device, [])
        for source, copied in copies:
            if source is inv_freq:
                return copied
        copies.append((inv_freq, inv_freq.to(device)))
        return copies[-1][1]

    def _forward_context(self, position_ids: Any) -> _ForwardContext:
        """The regime and cache geometry of the forward this attention call belongs to.

        A forward with gradients gets a ``position_ids`` tensor of its own (see
        :func:`_own_position_ids`); its first layer records what the forward set, under that
        tensor. Its other layers, and the same layers recomputed by gradient checkpointing during
        backward (after other forwards changed the current state), find that record. Any other
        call (without gradients, or a layer run on its own) reads the current state.
        """
        keyed = isinstance(position_ids, torch.Tensor)
        known = self.forward_contexts.get(position_ids) if keyed else None
        if known is not None:
            return known
        beyond = self.remap_applies is None or bool(self.remap_applies())
        if keyed and torch.is_grad_enabled() and threading.get_ident() in self.forward_threads.depths:
            context = self.forward_contexts[position_ids] = _ForwardContext(beyond, dict(self.geometry))
            return context
        return _ForwardContext(beyond, self.geometry)  # read at once: no copy

    def _current_remap(self, beyond_settle: bool) -> tuple[PositionRemap | None, torch.Tensor, KeyRotationTables]:
        """The remap of a forward, the frequencies it rotates with, and its key tables."""
        if beyond_settle:
            return self.remap_for(True), self.inv_freq, self.key_rotations
        if self.remap_below_settle is None:
            return None, self.inv_freq, self.key_rotations
        return self.remap_for(False), self.inv_freq_below_settle, self.key_rotations_below_settle

    def _check_caller(self, module: nn.Module) -> None:
        """Refuse an attention module that is not part of the patched model: a model built from a copy
        of its config (``from_config(patched.config)``, a deepcopy of it) carries this patch's private
        name without being patched, and would run this model's state, not its own."""
        if self._is_own(module):
            return
        model = None if self.hooked_model is None else self.hooked_model()
        if model is None:  # installed without a model (no hooks), or the model is gone: nothing to tell
            return
        modules = list(model.modules())  # modules added since they were last read
        self.own_module_ids = frozenset(id(each) for each in modules)
        self.own_hook_tables = frozenset(id(each._forward_pre_hooks) for each in modules)
        if not self._is_own(module):
            raise ValueError(
                f"{type(module).__name__} is not part of the model patched as {self.name!r}: its model was built from "
                "that patched model's config (or a copy), which carries this private attention name. Build it from the "
                "original config (AutoConfig.from_pretrained, or the patched model's config after unpatch_model), then "
                "patch it with patch_model."
            )

    def _is_own(self, module: nn.Module) -> bool:
        """One of the patched model's modules, or an nn.DataParallel replica of one."""
        return id(module) in self.own_module_ids or (
            getattr(module, "_is_replica", False) and id(module._forward_pre_hooks) in self.own_hook_tables
        )

    def attention(self, module: nn.Module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        """The attention function registered for this model (transformers' signature)."""
        self._check_caller(module)
        original = _attention_functions().get_interface(self.original_implementation, _eager_attention(module))
        position_ids = kwargs.get("position_ids")
        query_len, key_len = query.shape[2], key.shape[2]
        context = self._forward_context(position_ids)
        geometry = context.geometry.get((query_len, key_len))
        if position_ids is None:
            first = geometry.query_offset if geometry is not None else key_len - query_len
            position_ids = torch.arange(first, first + query_len, device=query.device)[None]
        if position_ids.device != query.device:
            position_ids = position_ids.to(query.device)
        remap, inv_freq, key_rotations = self._current_remap(context.beyond_settle)
        inv_freq = self._frequencies_on(inv_freq, query.device)
        memo = self.positions_memo.of(position_ids)
        # Layers without RoPE (SmolLM3's no_rope_layers) have no positions to remap.
        uses_rope = getattr(module, "use_rope", True)
        if memo.max_position < self.original_length or (remap is None and not self.logn) or not uses_rope:
            # Inside the native context every method is plain attention: the model's own kernel.
            if self.original_implementation in FLASH_IMPLEMENTATIONS:
                module = _ModuleWithImplementation(module, self.original_implementation)
            return original(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        if dropout and module.training:
            raise ValueError("attention-level methods do not support attention dropout during training; set it to 0.")
        if remap is not None and not self.warned_untrained_distance:
            self._warn_if_untrained_distance(remap, memo.max_position + 1)
        if attention_mask is None:
            # Without a mask the kernels tell earlier keys from later ones by position (a mask
            # would say it by slot): a repeated or decreasing position would let a token see later ones.
            cuts = kwargs.get("cu_seq_lens_q")
            wrong = memo.out_of_order(None if cuts is None else tuple(int(b) for b in cuts.reshape(-1).tolist()))
            if wrong is not None:
                row, token = wrong
                before, at = position_ids[row, token - 1].item(), position_ids[row, token].item()
                raise ValueError(
                    "attention-level methods need position_ids that increase along each sequence when the call has no "
                    f"attention mask; row {row} goes from {before} to {at} at token {token}. Give each token its own "
                    "position in order; pack sequences (restarting at 0) one row per batch, or pass an attention mask."
                )
        unsupported = [name for name in UNSUPPORTED_ATTENTION_ARGUMENTS if kwargs.get(name) is not None]
        if unsupported:  # check_attention_modules refuses the known cases at patch time
            raise ValueError(
                f"{type(module).__name__} passes {', '.join(unsupported)} to its attention function, which "
                "attention-level methods do not apply; unpatch_model and use a frequency method (yarn, dynamic-yarn)."
            )
        if torch.is_autocast_enabled(query.device.type):
            # Under autocast the rotated queries and keys are float32 (cos/sin are) and the values
            # already in the autocast type; the fused kernels are called below autocast, which
            # would have cast all three for the model's own attention: do the same.
            dtype = torch.get_autocast_dtype(query.device.type)
            query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        if geometry is not None:
            query_slot, key_offset = geometry.query_offset, geometry.key_offset
        elif isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
            # A 4-D mask of the caller's own (transformers then skips the mask function, which
            # records the geometry): a token sees itself, so the last allowed column of the last
            # query row is that query's slot (a static cache is longer than its tokens).
            query_slot, key_offset = _query_slot_from_mask(attention_mask, query_len, key_len), 0
        else:  # keys are the cached tokens followed by this call's
            query_slot, key_offset = key_len - query_len, 0
        key_positions = memo.key_positions(query_slot, key_offset, key_len)
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        # sdpa and eager masks carry the sliding window and packed sequences; flash attention's
        # (None, or a padding mask) carry neither, its kernel takes them as arguments
        flash_style = attention_mask is None or (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2)
        window = kwargs.get("sliding_window") if flash_style else None
        max_distance = None if window is None else int(window) - 1
        bounds = None
        # No mask: flash attention's packed sequences, or sdpa's causal-by-slot shortcut, which
        # transformers also takes for restarting positions when a cache is passed (use_cache's
        # default): each sequence is then computed alone, never seeing the next one's tokens.
        if attention_mask is None and (self.original_implementation in FLASH_IMPLEMENTATIONS or query_len == key_len):
            bounds = _packed_bounds(position_ids, kwargs, query_len, key_len, memo)
        if bounds is None:
            allowed = _mask_reader(attention_mask, query_len, key_len, position_ids, key_positions)
            output = self._remapped(query, key, value, position_ids, key_positions, allowed, remap, inv_freq,
                                    key_rotations, scaling, max_distance)
            weights = None
            if kwargs.get("output_attentions"):
                weights = self._weights(query, key, position_ids, key_positions, allowed, remap, inv_freq, scaling,
                                        max_distance)
            return output, weights
        if kwargs.get("output_attentions"):  # packed sequences come without a mask (flash, sdpa): no weights
            self._warn_no_weights()
        # Packed sequences: each is computed as if it were alone in its own forward (plain
        # attention inside L0), with key tables of its own.
        outputs = []
        for start, stop in zip(bounds, bounds[1:]):
            positions = position_ids[:, start:stop]
            own_remap = remap if int(positions.max()) >= self.original_length else None
            part = slice(start, stop)
            outputs.append(self._remapped(
                query[:, :, part], key[:, :, part], value[:, :, part], positions, positions,
                lambda first, last: None, own_remap, inv_freq, None, scaling, max_distance,
            ))
        return torch.cat(outputs, dim=1), None

    def _weights(self, query, key, query_positions, key_positions, allowed, remap, inv_freq, scaling, max_distance):
        """The attention weights for ``output_attentions``: eager models get them, as unpatched."""
        if self.original_implementation != "eager":
            self._warn_no_weights()
            return None
        return remapped_attention_weights(
            query, key, query_positions=query_positions, key_positions=key_positions, allowed=allowed, remap=remap,
            inv_freq=inv_freq, scaling=scaling, logn_length=self.original_length if self.logn else None,
            max_distance=max_distance,
        )

    def _warn_if_untrained_distance(self, remap: PositionRemap, length: int) -> None:
        """Warn once per patch when a sequence is longer than the remap covers: a fixed
        ``group_size`` keeps distances inside ``L0`` only up to the extended context it was checked for."""
        try:
            farthest = remap.max_distance(length)
        except NotImplementedError:  # a registered remap that does not say
            return
        if farthest >= self.original_length:
            self.warned_untrained_distance = True
            group = getattr(remap, "group_size", None)
            what = f"self-extend with group_size={group}" if group is not None else type(remap).__name__
            logger.warning(
                "%s: a sequence of %d tokens reaches relative distance %d, beyond the trained %d (its parameters were "
                "checked for the patch's extended context only); patch again with a larger scale%s.",
                what, length, farthest, self.original_length, ", or leave group_size unset" if group is not None else "",
            )

    def _warn_no_weights(self) -> None:
        if not self.warned_no_weights:  # once per patch, not once per layer
            self.warned_no_weights = True
            logger.warning(
                "output_attentions: attention-level methods return weights only for attn_implementation='eager' "
                "(this model: %r), as transformers does; load the model with attn_implementation='eager' to get "
                "them.", self.original_implementation,
            )

    def _remapped(self, query, key, value, query_positions, key_positions, allowed, remap, inv_freq, key_rotations,
                  scaling, max_distance):
        return remapped_attention(
            query,
            key,
            value,
            query_positions=query_positions,
            key_positions=key_positions,
            allowed=allowed,
            remap=remap,
            inv_freq=inv_freq,
            scaling=scaling,
            logn_length=self.original_length if self.logn else None,
            key_rotations=key_rotations,
            max_distance=max_distance,
        )

    def before_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Forward pre-hook of the model. Returns the call, with a copy of the caller's
        ``position_ids`` when gradients are on (see :meth:`_forward_context`).

        The geometry recorded by :meth:`mask` belongs to one forward: a forward whose mask
        function does not run must not read an earlier one's. Masks given by layer type (a dict)
        were built by the caller before the forward (``generate`` does so for a static cache of a
        model with ``layer_types``, Qwen2 and Qwen3): their geometry is read from the cache as
        transformers' mask preparation reads it (:func:`_cache_geometry`), since the mask
        function's records may belong to another cache's masks built meanwhile. A cache this patch did not fill
        (before patching, under another patch) is refused: its keys carry other rotations. And
        the cached keys are taken to sit at the positions just before the new tokens (see
        :func:`_key_positions`): a call that continues a cache with positions that jump is
        refused, not computed with wrong distances.
        """
        self._start_forward(module)
        self.geometry.clear()
        if torch.is_grad_enabled():
            args, kwargs = _own_position_ids(module, args, kwargs)
        arguments = _forward_arguments(module, args, kwargs)
        self._check_cache_continuation(module, args, kwargs, arguments)
        return args, kwargs

    def _check_cache_continuation(self, module: nn.Module, args: tuple, kwargs: dict, arguments: Any) -> None:
        """Read the geometry of masks given by layer type, refuse a cache filled otherwise, and
        refuse positions that do not continue the cache (see :meth:`before_forward`)."""
        name, cache, positions = _cache_and_positions(module, args, kwargs, arguments=arguments)
        if cache is None:
            return
        if isinstance(arguments.get("attention_mask"), Mapping):
            self.geometry.update(_cache_geometry(cache, _new_tokens(arguments, positions)))
        end = self.filled.check(cache, name)
        if end is None or end.last_positions is None or positions is None:
            return  # an empty cache, or last positions unknown (cropped, or taken from the cache)
        last = end.last_positions
        if positions.shape[0] != last.shape[0] and 1 not in (positions.shape[0], last.shape[0]):
            return
        expected = last.to(positions.device) + 1
        if bool((positions[:, 0] != expected).any()):
            raise ValueError(
                f"attention-level methods take the {end.tokens} cached tokens to sit just before the new ones, but the new "
                f"position_ids start at {positions[:, 0].tolist()}, not {expected.tolist()}. Continue a cache with the "
                "positions that follow it (a call without position_ids takes 0, 1, 2, ... in every row: give a padded "
                "batch its own, attention_mask.cumsum(-1) - 1, from the first call on), or run the whole sequence in "
                "one forward."
            )

    def after_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """Forward hook of the model: where the cache it filled ends (tokens, each row's last position)."""
        _, cache, positions = _cache_and_positions(module, args, kwargs, output)
        if cache is None:
            return
        self.filled.record(cache, None if positions is None else positions[:, -1].detach().clone())

    def _start_forward(self, module: nn.Module) -> None:
        """Count this thread's forward in; refuse it while another thread runs one of this model."""
        if self.forward_threads.enter(module) == 1:
            self.saved_lengths.clear()  # none can be under way: left by an interrupted forward
            self.saved_geometries.clear()
        self.saved_lengths.append(getattr(self.forward_state, "current_length", None))
        self.saved_geometries.append(dict(self.geometry))
        # a forward run inside another (by a hook) clears the outer one's memos too: it recomputes them
        self._forward_boundary(starting=True)

    def end_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """Forward hook of the model that runs even when the forward raised an exception: the
        memos' forward is over. (An interrupt, ``KeyboardInterrupt``, skips such hooks: the count
        is corrected from the stack at the next start, see ForwardThreads, and the memos stay on for
        layers called on their own until the next forward of the model ends.)"""
        depth = self.forward_threads.leave()
        if depth == 0:  # its start was refused
            return
        saved = self.saved_lengths.pop() if self.saved_lengths else None
        geometry = self.saved_geometries.pop() if self.saved_geometries else {}
        if depth > 1 and self.forward_state is not None:  # the enclosing forward goes on at its own length
            self.forward_state.current_length = saved
        if depth > 1:  # and with its own cache geometry (the inner forward's replaced it)
            self.geometry.clear()
            self.geometry.update(geometry)
        # memos off after every forward, an inner one (run by a hook) too: the outer one then
        # recomputes its remaining layers' positions, and a count left up by an interrupted
        # forward cannot keep them on
        self._forward_boundary(starting=False)

    def _forward_boundary(self, starting: bool) -> None:
        # The position memos serve the layers of one forward, never the next one (nor layers
        # called on their own afterwards: they hold no inference tensor across calls then).
        self.positions_memo.clear()
        self.positions_memo.within_forward = starting
        for tables in (self.key_rotations, self.key_rotations_below_settle):
            tables.last_call, tables.within_forward = None, starting

    def mask(self, *args, **kwargs):
        """The mask function registered for this model: the original one, plus the cache geometry."""
        q_length, kv_length = kwargs.get("q_length"), kwargs.get("kv_length")
        if q_length is not None and kv_length is not None:
            geometry = _Geometry(int(kwargs.get("q_offset") or 0), int(kwargs.get("kv_offset") or 0))
            self.geometry[(int(q_length), int(kv_length))] = geometry
        masks = _mask_functions()
        original = masks[self.original_implementation if self.original_implementation in masks else "sdpa"]
        return original(*args, **kwargs)


class _ModuleWithImplementation:
    """An attention module seen with ``config._attn_implementation`` set to ``implementation``.

    transformers' flash-attention function picks its kernel by the name in the module's config,
    which holds this patch's registry name while the patch is on; the model's own function must
    see its own name. Everything else is read from the module and its config."""

    def __init__(self, module: nn.Module, implementation: str):
        self._module = module
        self.config = _ConfigWithImplementation(module.config, implementation)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


class _ConfigWithImplementation:
    def __init__(self, config: Any, implementation: str):
        self._config = config
        self._attn_implementation = implementation

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def _key_positions(query_positions: torch.Tensor, query_slot: int, key_offset: int, key_len: int) -> torch.Tensor:
    """True positions of the keys ``(B, Tk)``.

    Key ``j`` sits in cache slot ``key_offset + j``; this call's queries were written to slots
    ``query_slot ...``, so those keys take the queries' own positions (any position ids, gaps
    included); older cached keys continue the first query's row backwards one position per
    slot (generation writes consecutive positions), and unwritten slots of a static cache
    forwards from the last query (they are masked out).
    """
    batch, query_len = query_positions.shape
    slots = key_offset + torch.arange(key_len, device=query_positions.device)
    before = query_positions[:, :1] - (query_slot - slots)[None]
    after = query_positions[:, -1:] + (slots - (query_slot + query_len - 1))[None]
    positions = torch.where(slots[None] < query_slot, before, after)
    inside = (slots >= query_slot) & (slots < query_slot + query_len)
    if bool(inside.any()):
        first = int(torch.nonzero(inside)[0])
        positions = positions.clone()
        count = int(inside.sum())
        start = int(slots[first]) - query_slot
        positions[:, first : first + count] = query_positions[:, start : start + count].expand(batch, -1)
    return positions


def _packed_bounds(position_ids: torch.Tensor, kwargs: Mapping[str, Any], query_len: int, key_len: int,
                   facts: _PositionFacts) -> list[int] | None:
    """Where the packed sequences of a flash-attention call start, as transformers' flash path reads
    them: ``cu_seq_lens_q`` if given, else every position equal to the row's smallest (batch 1,
    read from ``facts``, the memo of ``position_ids``); None for one sequence."""
    given = kwargs.get("cu_seq_lens_q")
    if given is not None:
        bounds = [int(b) for b in given.reshape(-1).tolist()]
        other = kwargs.get("cu_seq_lens_k")
        if other is not None and [int(b) for b in other.reshape(-1).tolist()] != bounds:
            raise ValueError("attention-level methods need cu_seq_lens_k equal to cu_seq_lens_q (packed sequences "
                             "without a cache); pass the same boundaries for both.")
    elif position_ids.shape[0] == 1 and query_len > 1:
        bounds = facts.restarts() + [query_len]
    else:
        return None
    if len(bounds) <= 2:
        return None
    if query_len != key_len or position_ids.shape[0] != 1 or bounds[0] != 0 or bounds[-1] != query_len or bounds != sorted(set(bounds)):
        raise ValueError(
            f"attention-level methods read packed sequences (boundaries {bounds[:4]}...) only in one row without a "
            f"cache, covering all {query_len} tokens; got {position_ids.shape[0]} rows, {key_len} keys. Run packed "
            "inputs without past_key_values, or load the model with attn_implementation='sdpa'."
        )
    return bounds


_FORWARD_SIGNATURES: dict[type, inspect.Signature] = {}  # per model class: read once, bound per forward


def _new_tokens(arguments: Mapping[str, Any], positions: torch.Tensor | None) -> int | None:
    """How many tokens a call of the model adds (None where it cannot tell)."""
    if positions is not None:
        return positions.shape[-1]
    for name in ("input_ids", "inputs_embeds"):
        given = arguments.get(name)
        if isinstance(given, torch.Tensor) and given.dim() >= 2:
            return given.shape[1]
    return None


def _cache_geometry(cache: Any, query_len: int | None) -> dict[tuple[int, int], _Geometry]:
    """The geometry transformers' mask preparation reads from ``cache`` for a call of
    ``query_len`` new tokens (``get_query_offset`` and ``get_mask_sizes`` of the first layer of
    each kind), keyed as :meth:`AttentionPatch.mask` records it; empty where the cache cannot say."""
    layers = getattr(cache, "layers", None)
    if query_len is None or not layers or not all(
        callable(getattr(cache, name, None)) for name in ("get_query_offset", "get_mask_sizes")
    ):
        return {}
    geometry, kinds = {}, set()
    for index, layer in enumerate(layers):
        if type(layer) in kinds:
            continue
        kinds.add(type(layer))
        try:
            query_offset = cache.get_query_offset(index)
            kv_length, kv_offset = cache.get_mask_sizes(query_len, index)
        except (TypeError, AttributeError, IndexError):  # another transformers version's cache
            return {}
        geometry[(int(query_len), int(kv_length))] = _Geometry(int(query_offset), int(kv_offset))
    return geometry


def _forward_signature(module: nn.Module) -> inspect.Signature:
    """The signature of ``module``'s forward, read once per class."""
    signature = _FORWARD_SIGNATURES.get(type(module))
    if signature is None:
        signature = _FORWARD_SIGNATURES[type(module)] = inspect.signature(module.forward)
    return signature


def _forward_arguments(module: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """A call to the model's forward, its arguments by name (None where they do not bind)."""
    from . import compat

    try:
        return compat.call_arguments(_forward_signature(module), args, kwargs)
    except TypeError:
        return None


def _own_position_ids(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call with a copy of the caller's ``position_ids``, if it gives them: a forward with
    gradients records its regime under the tensor its layers receive (see
    ``AttentionPatch._forward_context``), which must be its own. A caller's tensor may be given to
    several forwards, or refilled in place, before the backward that recomputes the first one."""
    if isinstance(kwargs.get("position_ids"), torch.Tensor):
        # In place: the dict is this call's own (built from its keywords), and the model's other
        # hooks (cache_consistency's) know the call by it.
        kwargs["position_ids"] = kwargs["position_ids"].clone()
        return args, kwargs
    names = list(_forward_signature(module).parameters)
    index = names.index("position_ids") if "position_ids" in names else None
    if index is not None and index < len(args) and isinstance(args[index], torch.Tensor):
        return (*args[:index], args[index].clone(), *args[index + 1:]), kwargs
    return args, kwargs


def _cache_and_positions(module: nn.Module, args: tuple, kwargs: dict, output: Any = None,
                         arguments: dict[str, Any] | None = None) -> tuple[str | None, Any, torch.Tensor | None]:
    """The name and KV cache of a call to the model, and its 2-D position ids (None where not
    given). With the call's ``output`` (it has run): the cache may be one the model made
    (use_cache=True without a cache), and positions not given are the ones the model took from
    the cache (the tokens it held before, one each: transformers' ``cache_position``).
    ``arguments``: the call's, already bound by :func:`_forward_arguments`."""
    from . import compat

    arguments = _forward_arguments(module, args, kwargs) if arguments is None else arguments
    if arguments is None:
        return None, None, None
    name, cache = compat.cache_argument(arguments)
    if output is not None and not compat.is_cache(cache):
        cache = compat.output_cache(output)
    cache = cache if compat.is_cache(cache) else None
    positions = arguments.get("position_ids")
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2:
        positions = None
        inputs = arguments.get("input_ids")
        inputs = arguments.get("inputs_embeds") if inputs is None else inputs
        if output is not None and cache is not None and isinstance(inputs, torch.Tensor) and inputs.dim() >= 2:
            held = int(cache.get_seq_length())
            positions = torch.arange(held - inputs.shape[1], held).expand(inputs.shape[0], -1)
    return name, cache, positions


def _query_slot_from_mask(attention_mask: torch.Tensor, query_len: int, key_len: int) -> int:
    """The cache slot of the first query, read from a 4-D mask: the last query row's last allowed
    column is its own slot (in the row with the most tokens: a padded query does not see itself)."""
    last_row = attention_mask[:, 0, -1, :key_len]
    allowed = last_row if last_row.dtype == torch.bool else last_row == 0
    columns = torch.arange(key_len, device=allowed.device).expand_as(allowed)
    last = int(torch.where(allowed, columns, -1).max())
    if last < query_len - 1:
        raise ValueError(
            f"attention-level methods could not place this call's {query_len} queries among {key_len} keys from its "
            "4-D attention mask; pass a 2-D (batch, sequence) mask instead."
        )
    return last - (query_len - 1)


def _mask_reader(attention_mask, query_len: int, key_len: int, query_positions, key_positions):
    """A function ``(start, end) -> allowed (B, 1, end - start, Tk) bool or None`` for any mask format."""
    if attention_mask is None:
        return lambda start, end: None
    if not isinstance(attention_mask, torch.Tensor):
        raise ValueError(
            f"attention-level methods need a tensor attention mask, got {type(attention_mask).__name__}; use "
            "attn_implementation 'sdpa' or 'eager'."
        )
    if attention_mask.dim() == 2:  # flash-attention style padding mask (B, Tk)
        padding = attention_mask.bool()[:, None, None, :]

        def allowed(start, end):
            causal = key_positions[:, None, None, :] <= query_positions[:, None, start:end, None]
            return causal & padding

        return allowed
    if attention_mask.dtype == torch.bool:
        return lambda start, end: attention_mask[:, :, start:end, :key_len]
    # eager: additive float mask, 0 where allowed
    return lambda start, end: attention_mask[:, :, start:end, :key_len] == 0


def _attention_functions():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS


def _mask_functions():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    return ALL_MASK_ATTENTION_FUNCTIONS


def _eager_attention(module: nn.Module):
    """The eager attention of ``module``'s own modeling file (Gemma2's caps its logits), else Llama's."""
    own = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if callable(own):
        return own
    from transformers.models.llama.modeling_llama import eager_attention_forward

    return eager_attention_forward


# Keyword arguments of transformers' attention functions that change the computation in ways the
# remapped attention does not reproduce (Gemma2's logit soft-capping, gpt-oss's attention sinks).
UNSUPPORTED_ATTENTION_ARGUMENTS = ("softcap", "s_aux", "sinks")


def check_attention_modules(model: nn.Module, config: Any, label: str, model_type: Any) -> None:
    """Refuse, before patching, a model whose attention an attention-level patch cannot reach or
    would compute differently: the patch replaces the attention function that the model's
    attention modules look up in transformers' registry (ALL_ATTENTION_FUNCTIONS)."""
    registry, bypassing = set(), set()
    for module in model.modules():
        # the names the forwards that run read: the class's own, and its bases' while each calls super()
        names: list[set] = []
        for cls in type(module).__mro__:
            if "forward" in vars(cls):
                names.append(set(getattr(getattr(inspect.unwrap(vars(cls)["forward"]), "__code__", None), "co_names", ())))
                if "super" not in names[-1]:
                    break
        if any("ALL_ATTENTION_FUNCTIONS" in each for each in names):
            registry.add(type(module).__name__)
        elif names and "_attn_implementation" in names[0] and type(module).__module__.startswith("transformers."):
            bypassing.add(type(module).__name__)  # chooses its attention by name, outside the registry (Falcon)
    if bypassing or not registry:
        which = f" ({', '.join(sorted(bypassing))})" if bypassing else ""
        raise ValueError(
            f"model_type {model_type!r}: its attention{which} does not go through transformers' attention registry, "
            f"which attention-level methods ({label!r}) replace per model; use a frequency method (yarn, dynamic-yarn)."
        )
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        raise ValueError(
            f"model_type {model_type!r} caps its attention logits (attn_logit_softcapping={softcap}), which "
            f"attention-level methods ({label!r}) do not do; use a frequency method (yarn, dynamic-yarn)."
        )


SUPPORTED_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3")
FLASH_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3")


def install(
    config: Any,
    remap: PositionRemap | None,
    inv_freq: torch.Tensor,
    original_length: int,
    logn: bool,
    remap_applies: Callable[[], bool] | None = None,
    remap_below_settle: PositionRemap | None = None,
    inv_freq_below_settle: torch.Tensor | None = None,
    model: nn.Module | None = None,
    method: str | None = None,
    forward_state: Any = None,
) -> AttentionPatch:
    """Route this model's attention through :meth:`AttentionPatch.attention`; see the module docstring.

    ``inv_freq`` are the frequencies the queries and keys are rotated with whenever the remap
    applies (``remap_applies()``, default always); otherwise ``remap_below_settle`` (if given)
    applies, with ``inv_freq_below_settle``. ``method``: the patch's name, for the refusal of a
    cache filled without it. ``forward_state``: the object whose ``current_length`` each forward
    sets (the rotary module), kept for a forward that another one, run inside it, interrupts."""
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    if implementation not in SUPPORTED_IMPLEMENTATIONS:
        raise ValueError(
            f"attention-level methods work with attn_implementation in {SUPPORTED_IMPLEMENTATIONS}, this model uses "
            f"{implementation!r}; load it with attn_implementation='sdpa'."
        )
    patch = AttentionPatch(
        config=config,
        name=_registry_name(implementation),
        original_implementation=implementation,
        remap=remap,
        inv_freq=inv_freq.detach().to(torch.float64).cpu(),
        original_length=original_length,
        logn=logn,
        remap_applies=remap_applies,
        remap_below_settle=remap_below_settle,
        inv_freq_below_settle=None if inv_freq_below_settle is None else inv_freq_below_settle.detach().to(torch.float64).cpu(),
        filled=FilledCaches(method),
        forward_state=forward_state,
    )
    if model is not None:  # bound methods, so that copy.deepcopy binds the copy's hooks to the copy's patch
        patch.hooked_model = weakref.ref(model)
        patch.hooks.append(model.register_forward_pre_hook(patch.before_forward, with_kwargs=True))
        patch.hooks.append(model.register_forward_hook(patch.after_forward, with_kwargs=True))
        patch.hooks.append(model.register_forward_hook(patch.end_forward, with_kwargs=True, always_call=True))
    _register(patch)
    config._attn_implementation = patch.name
    logger.info("Attention of this model routed through %s (was %r).", patch.name, implementation)
    return patch


def _copied_reference(reference: weakref.ref | None, memo: dict) -> weakref.ref | None:
    """A weak reference to the copy, made in the same ``copy.deepcopy``, of what ``reference`` points to."""
    target = None if reference is None else reference()
    copied = None if target is None else memo.get(id(target))
    return None if copied is None else weakref.ref(copied)


def _registry_name(implementation: str) -> str:
    # Unique to one model; the original name inside, so that transformers' checks by name ("flash"
    # in it) still see the model's kind.
    return f"hf_rope_ext_{uuid.uuid4().hex[:12]}_{implementation}"


_REGISTRY_NAME = re.compile(r"hf_rope_ext_[0-9a-f]{12}_(\w+)")


def implementation_behind(name: Any) -> str | None:
    """The model's own attention implementation inside a patch's registry name (None: ``name`` is
    not one): a config copied from a patched model names that model's patch."""
    match = _REGISTRY_NAME.fullmatch(name) if isinstance(name, str) else None
    return None if match is None else match.group(1)


def _register(patch: AttentionPatch) -> None:
    """Global registry entries for ``patch`` (masking_utils reads only the class-wide mapping of mask
    functions), keyed by its unique name.

    They hold the patch weakly: the model owns it (through its rotary module), so a deleted
    model is freed, and its entries are removed with it.
    """
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    reference = weakref.ref(patch)

    def attention(*args, **kwargs):
        return _live(reference).attention(*args, **kwargs)

    def mask(*args, **kwargs):
        return _live(reference).mask(*args, **kwargs)

    AttentionInterface.register(patch.name, attention)
    AttentionMaskInterface.register(patch.name, mask)
    weakref.finalize(patch, _remove_entries, patch.name)


def _live(reference: weakref.ref) -> AttentionPatch:
    patch = reference()
    if patch is None:
        raise RuntimeError(
            "This attention implementation belonged to a patched model that has been deleted; load or patch the model "
            "again instead of reusing its config."
        )
    return patch


def _remove_entries(name: str) -> None:
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface._global_mapping.pop(name, None)
    AttentionMaskInterface._global_mapping.pop(name, None)


def uninstall(patch: AttentionPatch) -> None:
    """Give the model its own attention back and remove the registry entries."""
    if getattr(patch.config, "_attn_implementation", None) == patch.name:
        patch.config._attn_implementation = patch.original_implementation
    _remove_entries(patch.name)
    for handle in patch.hooks:
        handle.remove()
    patch.hooks.clear()
    patch.geometry.clear()
    patch.key_rotations.clear()
    patch.key_rotations_below_settle.clear()
    patch.positions_memo.clear()
    patch.forward_threads.clear()
