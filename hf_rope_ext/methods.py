"""RoPE scaling methods: one pure frequency function per method, kept in a registry.

(Over 400 lines: every method's formula, checks and config writer sit together, each written once.)

Every method is a function with the same signature::

    compute(rotary_dim: int, base: float, params: Mapping[str, Any], seq_len: int | None)
        -> tuple[torch.Tensor, float]

returning the inverse frequencies ``inv_freq`` (float64, shape ``(rotary_dim // 2,)``) and the
attention factor that multiplies both cos and sin (so attention logits scale by its square).
``params`` always holds ``factor`` (the scale ``s``) and ``original_max_position_embeddings``
(``L0``, the context the model was trained on), plus the method's own parameters with their
defaults filled in. ``seq_len`` is the current sequence length; only length-dependent
("dynamic") methods read it.

Notation in the docstrings: ``d`` is the rotary dimension, ``b`` the base (``rope_theta``),
``theta_i = b ** (-2i / d)`` for ``i = 0 .. d/2 - 1`` the original inverse frequencies,
``lambda_i = 2 * pi / theta_i`` their wavelengths, ``s`` the scale, ``L0`` the original context
and ``L`` the current length.

Frequencies are computed in float64 here; the rotary module casts them once, to float32.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import math
import numbers
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .validation import is_real

__all__ = [
    "RUNTIMES",
    "RopeMethod",
    "default_inv_freq",
    "dynamic_ntk_base",
    "get_method",
    "list_methods",
    "ntk_base",
    "register_method",
    "unregister_method",
    "yarn_mscale",
]

ComputeFn = Callable[[int, float, Mapping[str, Any], "int | None"], "tuple[torch.Tensor, float]"]
# (params with factor and original_max_position_embeddings, rope_theta, rotary_dim) -> rope_parameters
RopeParametersFn = Callable[[Mapping[str, Any], float, int], dict]

# Runtimes a method can declare a translator for (see RopeMethod.runtimes).
RUNTIMES = ("vllm", "llama.cpp")

# Method-name suffix that adds log-n attention (hf_rope_ext.attention.logn_factor) to any method.
LOGN_SUFFIX = "+logn"

# Keys every method receives; users pass them through `scale=` / `max_length=` / `original_max_length=`.
COMMON_PARAMS = ("factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class RopeMethod:
    """A registered RoPE scaling method.

    Attributes:
        name: registry key, used as ``patch_model(..., method=name)``.
        compute: the pure frequency function (see module docstring).
        defaults: the method's own parameters and their defaults. A default of ``None`` means
            "derived from the other parameters"; :data:`REQUIRED` means the user must give it.
        length_dependent: the frequencies depend on the current length (dynamic methods). The
            patched model chooses them once for the length a sequence is planned to reach and
            recomputes the cached states (a prefill) when it goes past it
            (:mod:`hf_rope_ext.cache_consistency`).
        transformers_rope_type: the ``rope_type`` transformers implements natively with the same
            frequencies, or ``None``. ``"default"`` means "plain RoPE with another ``rope_theta``".
        rope_parameters: writes the patch in transformers' vocabulary: a function of the
            resolved parameters (with ``factor`` and ``original_max_position_embeddings``),
            ``rope_theta`` and the rotary dimension, returning ``config.rope_parameters``. Needed
            when ``transformers_rope_type`` is set; ``None`` writes this package's own rope type
            ``"hf_rope_ext.<name>"`` (:mod:`hf_rope_ext.config_io`).
        runtimes: runtime name (``"vllm"``, ``"llama.cpp"``) -> translator, a function
            ``(spec, model_type) -> hf_rope_ext.runtimes.RuntimeCommand`` giving the settings
            that run the patch there (``spec`` is a :class:`hf_rope_ext.spec.PatchSpec`,
            ``model_type`` the transformers model type or None), or a ``"module:function"``
            reference to one. A runtime without a translator is reported as unsupported.
        summary: one line for ``list_methods()`` and the README table.
        validate: optional check of the resolved parameters; raises ``ValueError``.
        attention: for attention-level methods, a function from the resolved parameters (with
            ``factor`` and ``original_max_position_embeddings``) to a
            :class:`hf_rope_ext.attention.PositionRemap`; it raises ``ValueError`` for bad values.
            Such methods keep (or set) the frequencies with ``compute`` and remap relative
            positions inside attention (see :mod:`hf_rope_ext.attention`).
        settle_length: for a length-dependent method, a function from the resolved parameters
            to the length beyond which its frequencies stop changing; if it is also
            attention-level, its position remap applies only to sequences longer than that
            (shorter ones get the frequencies alone). ``None``: the frequencies follow every length.
        attention_below_settle: for a method with a settle length, the position remap of
            sequences between the original context and the settle length (a function of the
            resolved parameters, like ``attention``). Such a method keeps the trained
            frequencies up to the settle length (checked when patching), so everything up to it
            is one state: a KV cache filled there is never recomputed before the settle length.
    """

    name: str
    compute: ComputeFn
    defaults: Mapping[str, Any] = field(default_factory=dict)
    length_dependent: bool = False
    transformers_rope_type: str | None = None
    summary: str = ""
    validate: Callable[[int, Mapping[str, Any]], None] | None = None
    attention: Callable[[Mapping[str, Any]], Any] | None = None
    rope_parameters: RopeParametersFn | None = None
    runtimes: Mapping[str, Callable[..., Any] | str] = field(default_factory=dict)
    settle_length: Callable[[Mapping[str, Any]], int] | None = None
    attention_below_settle: Callable[[Mapping[str, Any]], Any] | None = None

    # A method is its registry entry: a pickled patch names it (its functions may be lambdas or
    # closures, which pickle cannot store), and copies of a patched model share it.
    def __reduce__(self):
        return _registered_method, (self.name,)

    def __copy__(self) -> RopeMethod:
        return self

    def __deepcopy__(self, memo: dict) -> RopeMethod:
        return self

    def translator(self, runtime: str) -> Callable[..., Any] | None:
        """The method's translator for ``runtime`` (see ``runtimes``), or None if it declares none."""
        if runtime not in RUNTIMES:
            raise ValueError(f"Unknown runtime {runtime!r}; runtimes: {', '.join(RUNTIMES)}.")
        found = self.runtimes.get(runtime)
        if isinstance(found, str):  # "module:function", resolved on use (that module imports this one)
            module, _, name = found.partition(":")
            found = getattr(importlib.import_module(module), name)
        return found


class _Required:
    def __repr__(self) -> str:
        return "<required>"


REQUIRED: Any = _Required()

_REGISTRY: dict[str, RopeMethod] = {}
_BUILTIN: set[str] = set()


def _registered_method(name: str) -> RopeMethod:
    """The method a pickled patch names, from this process's registry."""
    if name not in _REGISTRY:
        raise ValueError(
            f"The pickled model was patched with RoPE method {name!r}, which is not registered in this process; "
            "register it (hf_rope_ext.register_method) before loading."
        )
    return _REGISTRY[name]


def default_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    """Plain RoPE (Su et al. 2021, arXiv 2104.09864): ``theta_i = b ** (-2i / d)``, in float64."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    return 1.0 / (base**exponents)


def yarn_mscale(scale: float) -> float:
    """YaRN's attention temperature ``sqrt(1/t) = 0.1 ln(s) + 1`` (arXiv 2309.00071, eq. 22); 1 when
    nothing is interpolated (``s <= 1``). vLLM and llama.cpp multiply their ``attn_factor`` by it."""
    return 1.0 if scale <= 1 else 0.1 * math.log(scale) + 1.0


def ntk_base(base: float, scale: float, rotary_dim: int) -> float:
    """NTK-aware base ``b' = b * s ** (d / (d - 2))``: the lowest frequency is divided by ``s``."""
    return base * scale ** (rotary_dim / (rotary_dim - 2))


def dynamic_ntk_base(base: float, scale: float, length: int, original_length: int, rotary_dim: int) -> float:
    """Dynamic NTK's base at length ``L``: the NTK base of ``s * L / L0 - (s - 1)`` beyond ``L0``,
    ``b`` inside it (the formula of transformers' and vLLM's ``dynamic``)."""
    if length <= original_length:
        return base
    return ntk_base(base, scale * length / original_length - (scale - 1), rotary_dim)


def _yarn_inv_freq(rotary_dim: int, base: float, scale: float, params: Mapping[str, Any]) -> torch.Tensor:
    """NTK-by-parts frequencies (shared by ``yarn`` and ``dynamic-yarn``)."""
    theta = default_inv_freq(rotary_dim, base)
    if scale <= 1:
        return theta
    original_length = params["original_max_position_embeddings"]

    def dim_for_rotations(rotations: float) -> float:
        # Dimension index whose wavelength fits `rotations` times into L0:
        # L0 / lambda_i = rotations  <=>  i = d * ln(L0 / (2 pi r)) / (2 ln b).
        return rotary_dim * math.log(original_length / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = dim_for_rotations(params["beta_fast"])
    high = dim_for_rotations(params["beta_slow"])
    if params["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    index = torch.arange(rotary_dim // 2, dtype=torch.float64)
    ramp = ((index - low) / (high - low)).clamp(0, 1)  # 0: keep theta_i, 1: interpolate theta_i / s
    return theta * (1 - ramp) + (theta / scale) * ramp


# ----------------------------------------------------------------------------------------------
# The methods
# ----------------------------------------------------------------------------------------------


def linear_inv_freq(rotary_dim: int, base: float, params: Mapping[str, Any], seq_len: int | None = None):
    """Linear scaling, Position Interpolation (Chen et al. 2023, arXiv 2306.15595; kaiokendev).

    Positions are divided by the scale: position ``m`` at scale ``s`` is rotated exactly as the
    original model rotates position ``m / s``. Scaling the positions is the same as scaling the
    frequencies, since the angle is ``m * theta_i``:

        theta'_i = theta_i / s,    attention factor 1.

    Needs fine-tuning to work well (about 200 steps in the paper); without it, perplexity rises
    inside the original context too, because nearby tokens are squeezed together.
    """
    return default_inv_freq(rotary_dim, base) / params["factor"], 1.0


def ntk_inv_freq(rotary_dim: int, base: float, params: Mapping[str, Any], seq_len: int | None = None):
    """Static NTK-aware scaling (bloc97, 2023; analysed in the YaRN paper, arXiv 2309.00071, sec. 3.1).

    Raise the base so that the lowest frequency is interpolated by ``s`` while the highest stays
    almost untouched (high frequencies extrapolate, low ones interpolate):

        b' = b * s ** (d / (d - 2)),    theta'_i = b' ** (-2i / d),    attention factor 1.

    This is plain RoPE with a larger ``rope_theta``, so every runtime can load it.
    """
    return default_inv_freq(rotary_dim, ntk_base(base, params["factor"], rotary_dim)), 1.0


def _effective_length(params: Mapping[str, Any], seq_len: int | None) -> int:
    original_length = params["original_max_position_embeddings"]
    return original_length if seq_len is None else max(int(seq_len), original_length)


def dynamic_ntk_inv_freq(rotary_dim: int, base: float, params: Mapping[str, Any], seq_len: int | None = None):
    """Dynamic NTK scaling (emozilla, 2023; YaRN paper, arXiv 2309.00071, sec. 3.3).

    NTK-aware scaling whose scale follows the current length ``L``; inside the original context
    the model is unchanged. With ``s`` the configured scale (the same formula as transformers'
    ``dynamic`` type):

        b'(L) = b * (s * L / L0 - (s - 1)) ** (d / (d - 2))    for L > L0,   b'(L) = b otherwise.

    The effective scale ``s * L / L0 - (s - 1)`` is 1 at ``L = L0`` and grows by ``s`` per
    further ``L0`` tokens: at ``L = s * L0`` it is ``s**2 - s + 1``, more than ``s``. This is the
    original formula (and transformers' and vLLM's); ``dynamic-yarn`` uses ``L / L0`` instead.
    """
    length = _effective_length(params, seq_len)
    original_length = params["original_max_position_embeddings"]
    scaled_base = dynamic_ntk_base(base, params["factor"], length, original_length, rotary_dim)
    return default_inv_freq(rotary_dim, scaled_base), 1.0


def yarn_inv_freq(rotary_dim: int, base: float, params: Mapping[str, Any], seq_len: int | None = None):
    """YaRN: NTK-by-parts interpolation plus attention temperature (Peng et al., ICLR 2024, arXiv 2309.00071).

    Each dimension is treated by how many full turns its wavelength makes inside ``L0``,
    ``r_i = L0 / lambda_i``. Dimensions that turn more than ``beta_fast`` times are left alone
    (extrapolated), those turning less than ``beta_slow`` times are interpolated by ``s``, and a
    linear ramp blends the two in between:

        gamma_i = clamp((i - i_fast) / (i_slow - i_fast), 0, 1),
        theta'_i = (1 - gamma_i) * theta_i + gamma_i * theta_i / s,
        i_r = d * ln(L0 / (2 pi r)) / (2 ln b)   (the dimension that turns r times in L0).

    The softmax temperature ``sqrt(1/t) = 0.1 ln(s) + 1`` (eq. 22) is folded into cos and sin as
    the attention factor, unless ``attention_factor`` is given. Defaults ``beta_fast=32``,
    ``beta_slow=1`` and floor/ceil rounding of ``i_fast``/``i_slow`` follow the paper's code and
    transformers' ``yarn`` type.
    """
    factor = params["factor"]
    attention_factor = params["attention_factor"]
    if attention_factor is None:
        attention_factor = yarn_mscale(factor)
    return _yarn_inv_freq(rotary_dim, base, factor, params), float(attention_factor)


def dynamic_yarn_inv_freq(rotary_dim: int, base: float, params: Mapping[str, Any], seq_len: int | None = None):
    """Dynamic YaRN (YaRN paper, arXiv 2309.00071, sec. 3.3 and 3.4).

    YaRN whose scale follows the current length: ``s(L) = max(1, L / L0)``; the temperature
    follows too, ``sqrt(1/t) = 0.1 ln s(L) + 1``. Inside the original context the model is
    exactly the original one, and at ``L`` beyond it the model sees the least interpolation that
    still covers ``L``. The configured scale only sets the advertised context length.
    """
    length = _effective_length(params, seq_len)
    return _yarn_at(rotary_dim, base, length / params["original_max_position_embeddings"], params)


def _yarn_at(rotary_dim: int, base: float, scale: float, params: Mapping[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN at ``scale`` (the original RoPE at 1 or below), temperature from the scale unless given."""
    if scale <= 1:
        return default_inv_freq(rotary_dim, base), 1.0
    attention_factor = params["attention_factor"]
    if attention_factor is None:
        attention_factor = yarn_mscale(scale)
    return _yarn_inv_freq(rotary_dim, base, scale, params), float(attention_factor)


def dynamic_yarn_dca_inv_freq(rotary_dim: int, base: float, params: Mapping[str, Any], seq_len: int | None = None):
    """Dynamic YaRN up to ``s_f L0`` tokens, then YaRN x ``s_f`` under Dual Chunk Attention.

    The frequencies are dynamic YaRN's (arXiv 2309.00071, sec. 3.3) with the scale capped at
    ``s_f`` (``frequencies_scale``, default 2): ``s(L) = min(max(1, L / L0), s_f)``, temperature
    ``sqrt(1/t) = 0.1 ln s(L) + 1``. Sequences longer than ``s_f L0`` also get Dual Chunk
    Attention (An et al. 2024, arXiv 2402.17463; ``chunk_size``, ``local_window`` as in
    ``dual-chunk``) on those frequencies, as Qwen2.5-1M pairs DCA with YaRN. So the model is the
    original one inside ``L0``, ``dynamic-yarn`` up to ``s_f L0`` and
    ``dual-chunk:frequencies=yarn,frequencies_scale=s_f`` beyond: YaRN where its interpolation is
    mild, chunked positions where stretching the frequencies further would cost more.
    """
    scale = _effective_length(params, seq_len) / params["original_max_position_embeddings"]
    return _yarn_at(rotary_dim, base, min(scale, float(params["frequencies_scale"])), params)


def _dynamic_yarn_dca_settle_length(params: Mapping[str, Any]) -> int:
    return math.ceil(params["frequencies_scale"] * params["original_max_position_embeddings"])


def self_extend_dca_inv_freq(rotary_dim: int, base: float, params: Mapping[str, Any], seq_len: int | None = None):
    """Self-Extend on the trained frequencies up to ``s_f L0`` tokens, then YaRN x ``s_f`` under Dual Chunk Attention.

    Up to ``s_f L0`` tokens (``frequencies_scale``, default 2) the frequencies are the trained
    ones, ``theta'_i = theta_i``, and sequences longer than ``L0`` get Self-Extend (Jin et al.
    2024, arXiv 2401.01325) with YaRN's NTK-by-parts split of the far positions
    (``far_positions="by-parts"``; ``neighbor_window`` default ``L0 / 4``, a group size per
    query; see ``self-extend``). Beyond ``s_f L0`` they are YaRN's at scale ``s_f`` (arXiv
    2309.00071; temperature ``sqrt(1/t) = 0.1 ln s_f + 1``) under Dual Chunk Attention (An et
    al. 2024, arXiv 2402.17463; ``chunk_size``, ``local_window``), exactly as
    ``dynamic-yarn-dca`` there. So the model is the original one inside ``L0``; between ``L0``
    and ``s_f L0`` every trained rotation is kept and only far distances are compressed, where
    ``dynamic-yarn`` would stretch every long wavelength; beyond, the chunked positions that
    carry retrieval to 8x.
    """
    return _trained_then_yarn(rotary_dim, base, params, seq_len)


def self_extend_yarn_inv_freq(rotary_dim: int, base: float, params: Mapping[str, Any], seq_len: int | None = None):
    """Self-Extend with by-parts far positions at every length, on the trained frequencies up to ``s_f L0``
    tokens and on YaRN x ``s_f`` beyond.

    Sequences longer than ``L0`` get Self-Extend (Jin et al. 2024, arXiv 2401.01325) with YaRN's
    NTK-by-parts split of the far positions (``far_positions="by-parts"``; ``neighbor_window``
    default ``L0 / 4``, a group size per query; see ``self-extend``). Up to ``s_f L0`` tokens
    (``frequencies_scale``, default 2) it rotates with the trained frequencies,
    ``theta'_i = theta_i``; beyond, with YaRN's at scale ``s_f`` (arXiv 2309.00071, temperature
    ``sqrt(1/t) = 0.1 ln s_f + 1``), as Self-Extend on ``frequencies="yarn",
    frequencies_scale=s_f``: the groups keep every distance inside ``L0`` and YaRN's mild
    interpolation lets the far, compressed positions be read at 4x and beyond, where Self-Extend
    on the trained frequencies loses facts (README, "Results").
    """
    return _trained_then_yarn(rotary_dim, base, params, seq_len)


def _trained_then_yarn(rotary_dim: int, base: float, params: Mapping[str, Any], seq_len: int | None):
    if _effective_length(params, seq_len) <= _dynamic_yarn_dca_settle_length(params):
        return default_inv_freq(rotary_dim, base), 1.0
    return _yarn_at(rotary_dim, base, float(params["frequencies_scale"]), params)


def _self_extend_by_parts(params: Mapping[str, Any], method: str, length: int | None = None):
    """The Self-Extend remap (by-parts far positions, a group per query) of ``method``'s parameters,
    for sequences up to ``length`` tokens (default the patch's target)."""
    original = params["original_max_position_embeddings"]
    window = params.get("neighbor_window")
    inner = {
        "original_max_position_embeddings": original,
        "factor": params["factor"] if length is None else length / original,
        # L0 / 4: with by-parts far positions it beats L0 / 2 on retrieval at 2x (README)
        "neighbor_window": max(1, original // 4) if window is None else window,
        "group_size": None,
        "far_positions": "by-parts",
    }
    return _attention().self_extend_remap(inner, method=method)


def _self_extend_below_settle(params: Mapping[str, Any]):
    """The Self-Extend remap of ``self-extend-dca`` below its settle length."""
    return _self_extend_by_parts(params, "self-extend-dca", _dynamic_yarn_dca_settle_length(params))


def _check_dynamic_yarn_dca(rotary_dim: int, params: Mapping[str, Any]) -> None:
    _check_betas(rotary_dim, params)
    scale = params.get("frequencies_scale")
    if not is_real(scale) or not math.isfinite(scale) or scale <= 1:
        raise ValueError(
            f"frequencies_scale must be a number above 1 (the largest YaRN scale; dual chunk attention "
            f"takes over beyond frequencies_scale x the original context), got {scale!r}."
        )


def attention_level_inv_freq(rotary_dim: int, base: float, params: Mapping[str, Any], seq_len: int | None = None):
    """Frequencies of the attention-level methods (``self-extend``, ``dual-chunk``).

    By default the trained ones, unchanged (``theta'_i = theta_i``, attention factor 1): these
    methods keep every trained rotation and remap relative positions inside attention. With
    ``frequencies="yarn"`` (or another static frequency method, with that method's default
    parameters) they combine both, as DCA does with position interpolation (ChunkLlama) and
    with YaRN (Qwen2.5-1M). The frequencies are those of the patch's scale, or of
    ``frequencies_scale``: the remap already keeps every distance inside the trained context,
    so a smaller interpolation than the target length's can be enough, at a smaller cost.
    """
    name = params.get("frequencies")
    if name is None:
        return default_inv_freq(rotary_dim, base), 1.0
    method = get_method(name)
    inner = {**method.defaults, **{key: params[key] for key in COMMON_PARAMS}}
    if params.get("frequencies_scale") is not None:
        inner["factor"] = float(params["frequencies_scale"])
    return method.compute(rotary_dim, base, inner, None)


def _check_frequencies(rotary_dim: int, params: Mapping[str, Any]) -> None:
    name = params.get("frequencies")
    allowed = [key for key, method in _REGISTRY.items() if not method.length_dependent and method.attention is None
               and not any(value is REQUIRED for value in method.defaults.values())]  # fmt: skip
    if name is not None and name not in allowed:
        raise ValueError(f"frequencies={name!r} is not a static frequency method; use None (the trained ones) or one of {allowed}.")
    scale = params.get("frequencies_scale")
    if scale is None:
        return
    if name is None:
        raise ValueError("frequencies_scale sets the scale of frequencies=; give frequencies= too (e.g. 'yarn').")
    if not is_real(scale) or not math.isfinite(scale) or scale <= 1:
        raise ValueError(f"frequencies_scale must be a number above 1 (the interpolation of frequencies=), got {scale!r}.")


def dynamic_linear_inv_freq(rotary_dim: int, base: float, params: Mapping[str, Any], seq_len: int | None = None):
    """Dynamic linear interpolation (emozilla, 2023).

    Position Interpolation whose scale follows the current length, ``s(L) = max(1, L / L0)``:

        theta'_i = theta_i / s(L).

    Unchanged inside the original context; at ``L = s * L0`` it equals ``linear`` at scale ``s``.
    """
    length = _effective_length(params, seq_len)
    scale = length / params["original_max_position_embeddings"]
    return default_inv_freq(rotary_dim, base) / max(scale, 1.0), 1.0


def llama3_inv_freq(rotary_dim: int, base: float, params: Mapping[str, Any], seq_len: int | None = None):
    """Llama 3.1 frequency-band interpolation (Meta, "The Llama 3 Herd of Models", arXiv 2407.21783).

    Wavelengths shorter than ``L0 / high_freq_factor`` are kept, those longer than
    ``L0 / low_freq_factor`` are interpolated by ``s``, and the band between is blended by a
    smooth factor linear in ``L0 / lambda_i``:

        theta'_i = theta_i                              if lambda_i < L0 / high_freq_factor
        theta'_i = theta_i / s                          if lambda_i > L0 / low_freq_factor
        theta'_i = (1 - a_i) theta_i / s + a_i theta_i  otherwise,
        a_i = (L0 / lambda_i - low_freq_factor) / (high_freq_factor - low_freq_factor).

    Defaults ``low_freq_factor=1``, ``high_freq_factor=4`` are those of Llama 3.1.
    """
    theta = default_inv_freq(rotary_dim, base)
    factor = params["factor"]
    original_length = params["original_max_position_embeddings"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    wavelength = 2 * math.pi / theta
    smooth = ((original_length / wavelength - low) / (high - low)).clamp(0, 1)
    return (1 - smooth) * theta / factor + smooth * theta, 1.0


def longrope_inv_freq(rotary_dim: int, base: float, params: Mapping[str, Any], seq_len: int | None = None):
    """LongRoPE with given per-dimension factors (Ding et al. 2024, arXiv 2402.13753; Phi-3).

    Each frequency is divided by its own factor, searched offline (the search is not part of
    this function): ``long_factor`` beyond the original context, ``short_factor`` inside it:

        theta'_i = theta_i / lambda_i^long    if L > L0,   theta_i / lambda_i^short otherwise,
        attention factor = sqrt(1 + ln(s) / ln(L0))   unless ``attention_factor`` is given.

    ``short_factor`` defaults to all ones (the original model inside its context).
    """
    original_length = params["original_max_position_embeddings"]
    half = rotary_dim // 2
    short_factor = params["short_factor"] if params["short_factor"] is not None else [1.0] * half
    use_long = seq_len is not None and int(seq_len) > original_length
    factors = torch.tensor(params["long_factor"] if use_long else short_factor, dtype=torch.float64)
    attention_factor = params["attention_factor"]
    if attention_factor is None:
        factor = params["factor"]
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original_length))
    return default_inv_freq(rotary_dim, base) / factors, float(attention_factor)


# ----------------------------------------------------------------------------------------------
# Parameter checks
# ----------------------------------------------------------------------------------------------


def _check_betas(rotary_dim: int, params: Mapping[str, Any]) -> None:
    if not params["beta_fast"] > params["beta_slow"] > 0:
        raise ValueError(
            f"YaRN needs beta_fast > beta_slow > 0, got beta_fast={params['beta_fast']}, "
            f"beta_slow={params['beta_slow']}; the paper's values are beta_fast=32, beta_slow=1."
        )
    _check_optional_positive("attention_factor", params["attention_factor"])


def _check_llama3(rotary_dim: int, params: Mapping[str, Any]) -> None:
    if not params["high_freq_factor"] > params["low_freq_factor"] > 0:
        raise ValueError(
            f"llama3 needs high_freq_factor > low_freq_factor > 0, got high_freq_factor="
            f"{params['high_freq_factor']}, low_freq_factor={params['low_freq_factor']} (Llama 3.1 uses 4 and 1)."
        )


def _check_longrope(rotary_dim: int, params: Mapping[str, Any]) -> None:
    half = rotary_dim // 2
    for key in ("long_factor", "short_factor"):
        values = params[key]
        if values is None and key == "short_factor":
            continue
        if isinstance(values, torch.Tensor):
            values = values.tolist()
        if not isinstance(values, (list, tuple)) or len(values) != half:
            raise ValueError(
                f"longrope's {key} must be a list of {half} numbers (rotary dimension {rotary_dim} / 2), "
                f"got {type(values).__name__} of length {len(values) if hasattr(values, '__len__') else 'n/a'}."
            )
        if not all(is_real(v) and math.isfinite(v) and v > 0 for v in values):
            raise ValueError(f"longrope's {key} must hold finite numbers > 0.")
    _check_optional_positive("attention_factor", params["attention_factor"])


def _first_line(text: str | None) -> str:
    lines = (text or "").strip().splitlines()
    return lines[0] if lines else ""


# The smallest attention factor kept as a normal float32: below it cos and sin round to 0 (or
# to subnormals), and attention loses every position (uniform weights).
MIN_ATTENTION_FACTOR = torch.finfo(torch.float32).tiny


def _check_optional_positive(name: str, value: Any) -> None:
    if value is not None and not (is_real(value) and math.isfinite(value) and value >= MIN_ATTENTION_FACTOR):
        raise ValueError(
            f"{name} must be a finite number > 0 (at least {MIN_ATTENTION_FACTOR:.3g}, float32's smallest normal "
            f"number) or None (derived), got {value!r}."
        )


def checked_frequencies(
    method: RopeMethod, rotary_dim: int, base: float, params: Mapping[str, Any], seq_len: int | None
) -> tuple[torch.Tensor, float]:
    """``method.compute(...)``, checked: ``(inv_freq float64 on CPU, attention_factor float)``
    (inv_freq stays on the meta device when it was made there, with only its shape checked).

    A method's output is refused, naming the method and the length, unless it is a pair of
    ``rotary_dim // 2`` real (not integer or complex) frequencies, all finite and > 0, and a
    finite attention factor > 0: anything else would make the model output NaN or garbage.
    """
    where = f"RoPE method {method.name!r} (at {'the original context' if seq_len is None else f'length {seq_len}'})"
    try:
        result = method.compute(rotary_dim, base, params, seq_len)
    except ArithmeticError as error:  # overflow or division by zero from finite but absurd parameters
        raise ValueError(f"{where} cannot compute its frequencies with {dict(params)} ({error}).") from None
    except ValueError as error:
        if str(error) != "math domain error":  # the method's own message names its problem
            raise
        raise ValueError(f"{where} cannot compute its frequencies with {dict(params)} (math domain error).") from None
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise ValueError(
            f"{where} returned {'None' if result is None else 'a ' + type(result).__name__}; a method must return "
            "the pair (inv_freq, attention_factor)."
        )
    inv_freq, attention_factor = result
    if isinstance(inv_freq, torch.Tensor) and not inv_freq.is_floating_point():
        raise ValueError(f"{where} returned inv_freq of dtype {inv_freq.dtype}; it must be a floating-point tensor.")
    try:
        inv_freq = torch.as_tensor(inv_freq, dtype=torch.float64).detach()
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"{where} returned inv_freq that is not a tensor of real numbers ({error}).") from None
    if inv_freq.shape != (rotary_dim // 2,):
        raise ValueError(
            f"{where} returned inv_freq of shape {tuple(inv_freq.shape)}, expected ({rotary_dim // 2},) "
            f"(rotary dimension {rotary_dim} / 2)."
        )
    meta = inv_freq.device.type == "meta"  # from_pretrained builds models on the meta device: no values yet
    inv_freq = inv_freq if meta else inv_freq.cpu()
    bad = None if meta else ~(torch.isfinite(inv_freq) & (inv_freq > 0))
    if bad is not None and bad.any():
        index = int(bad.nonzero()[0])
        raise ValueError(
            f"{where} returned inv_freq[{index}] = {inv_freq[index].item()!r}; every frequency must be finite and > 0."
        )
    scalar_tensor = isinstance(attention_factor, torch.Tensor) and attention_factor.numel() == 1
    if not (is_real(attention_factor) or scalar_tensor):
        raise ValueError(f"{where} returned attention factor {attention_factor!r}; it must be a number.")
    attention_factor = float(attention_factor)
    if not (math.isfinite(attention_factor) and attention_factor >= MIN_ATTENTION_FACTOR):
        raise ValueError(
            f"{where} returned attention factor {attention_factor!r}; it must be finite and > 0 (at least "
            f"{MIN_ATTENTION_FACTOR:.3g}, float32's smallest normal number)."
        )
    return inv_freq, attention_factor


# ----------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------

_YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": None, "truncate": True}


# -- writers of transformers' own rope types (RopeMethod.rope_parameters) -----------------------


def _own_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """The method's own parameters that are set, as JSON values."""
    return {key: plain_value(value) for key, value in params.items() if key not in COMMON_PARAMS and value is not None}


def _plain_rope_parameters(params: Mapping[str, Any], base: float, rotary_dim: int) -> dict[str, Any]:
    # ntk: plain RoPE with the raised base the method computes
    return {"rope_type": "default", "rope_theta": ntk_base(base, params["factor"], rotary_dim)}


def _linear_rope_parameters(params: Mapping[str, Any], base: float, rotary_dim: int) -> dict[str, Any]:
    return {"rope_type": "linear", "rope_theta": base, "factor": params["factor"]}


def _dynamic_rope_parameters(params: Mapping[str, Any], base: float, rotary_dim: int) -> dict[str, Any]:
    return {"rope_type": "dynamic", "rope_theta": base, "factor": params["factor"]}


def _with_original_context(rope_type: str) -> RopeParametersFn:
    """yarn and llama3: factor, the original context and the method's own parameters."""

    def write(params: Mapping[str, Any], base: float, rotary_dim: int) -> dict[str, Any]:
        rope = {
            "rope_type": rope_type,
            "rope_theta": base,
            "factor": params["factor"],
            "original_max_position_embeddings": int(params["original_max_position_embeddings"]),
            **_own_params(params),
        }
        if "attention_factor" in rope:
            rope["attention_factor"] = float(rope["attention_factor"])  # transformers wants a float
        return rope

    return write


def _longrope_rope_parameters(params: Mapping[str, Any], base: float, rotary_dim: int) -> dict[str, Any]:
    own = _own_params(params)
    rope = {
        "rope_type": "longrope",
        "rope_theta": base,
        "factor": params["factor"],
        "original_max_position_embeddings": int(params["original_max_position_embeddings"]),
        "long_factor": own["long_factor"],
        "short_factor": own.get("short_factor", [1.0] * (rotary_dim // 2)),
    }
    if "attention_factor" in own:
        rope["attention_factor"] = float(own["attention_factor"])
    return rope


# transformers rope_type -> writer, for methods registered with a transformers_rope_type only
_NATIVE_WRITERS: dict[str, RopeParametersFn] = {
    "default": _plain_rope_parameters,
    "linear": _linear_rope_parameters,
    "dynamic": _dynamic_rope_parameters,
    "yarn": _with_original_context("yarn"),
    "llama3": _with_original_context("llama3"),
    "longrope": _longrope_rope_parameters,
}


def _builtin_runtimes(name: str) -> dict[str, str]:
    """References to a built-in method's translators in :mod:`hf_rope_ext.runtimes` (also those that
    explain why a runtime cannot run it)."""
    function = name.replace("-", "_")
    return {"vllm": f"hf_rope_ext.runtimes:vllm_{function}", "llama.cpp": f"hf_rope_ext.runtimes:llama_cpp_{function}"}


def register_method(
    name: str,
    compute: ComputeFn,
    *,
    defaults: Mapping[str, Any] | None = None,
    length_dependent: bool = False,
    summary: str = "",
    validate: Callable[[int, Mapping[str, Any]], None] | None = None,
    transformers_rope_type: str | None = None,
    attention: Callable[[Mapping[str, Any]], Any] | None = None,
    rope_parameters: RopeParametersFn | None = None,
    runtimes: Mapping[str, Callable[..., Any] | str] | None = None,
) -> RopeMethod:
    """Register a user-defined RoPE scaling method under ``name``.

    ``compute(rotary_dim, base, params, seq_len) -> (inv_freq, attention_factor)`` must be a pure
    function; ``params`` holds ``factor``, ``original_max_position_embeddings`` and the keys of
    ``defaults``. Set ``length_dependent=True`` if it reads ``seq_len``; the patched model then
    recomputes frequencies as the input grows and keeps the KV cache consistent. ``attention``
    makes it an attention-level method (see :class:`RopeMethod`).

    ``transformers_rope_type`` names a rope type transformers has with the same frequencies
    (checkpoints then load without this package); ``rope_parameters`` writes its config entry
    (defaults to the writer of that type). ``runtimes`` declares how vLLM and llama.cpp run the
    method: ``{"llama.cpp": translate}`` with ``translate(spec, model_type)`` returning a
    :class:`hf_rope_ext.runtimes.RuntimeCommand`; :func:`hf_rope_ext.runtimes.runtime_settings`
    then reports it (runtimes without a translator are reported as unsupported). Example::

        from hf_rope_ext.runtimes import RuntimeCommand, llama_cpp_command

        def to_llama_cpp(spec, model_type):
            base = spec.original_rope_theta * 2
            return llama_cpp_command(spec, model_type, {"--rope-scaling": "none", "--rope-freq-base": base})

        register_method("my-ntk", compute, runtimes={"llama.cpp": to_llama_cpp})

    The method can then be used as ``patch_model(model, scale, method=name)``, and checkpoints
    saved with it load through ``from_pretrained`` in any process that registered it. Names hold
    letters, digits, ``_``, ``.`` and ``-``. Raises ``ValueError`` if the name is taken (call
    :func:`unregister_method` first to replace a user method; built-in methods cannot be replaced).
    The keys of ``defaults`` are the parameters' names: identifiers, other than the keywords
    ``patch_model``, ``PatchSpec.create``, ``describe_patch`` and ``runtime_settings`` take
    themselves (``scale``, ``method``, ``rope_theta``, ``partial_rotary_factor``, ...), which could
    never reach the method.
    """
    if not isinstance(name, str) or not name or name != name.strip():
        raise ValueError(f"Method name must be a non-empty string without surrounding spaces, got {name!r}.")
    if name in ("auto", "none") or name.endswith(LOGN_SUFFIX):
        raise ValueError(
            f"Method name {name!r} is reserved ('auto' chooses a method by measuring, 'none' names the unpatched "
            f"model in evaluations, a {LOGN_SUFFIX!r} suffix turns on log-n attention); choose another name."
        )
    if not _METHOD_NAME.fullmatch(name):
        # ':', ';', ',' and '=' separate configurations and parameters on command lines ("yarn:beta_fast=16;ntk").
        raise ValueError(f"Method name {name!r} may only hold letters, digits, '_', '.' and '-'; choose another name.")
    if "dynamic" in name and not length_dependent and transformers_rope_type is None:
        # transformers scales rope types named "dynamic..." only beyond max_position_embeddings.
        raise ValueError(
            f"Method name {name!r} contains 'dynamic', which transformers reads as length-dependent; choose another "
            "name for a static method, or pass length_dependent=True if it reads seq_len."
        )
    if name in _REGISTRY:
        kind = "a built-in method" if name in _BUILTIN else "already registered"
        raise ValueError(f"RoPE method {name!r} is {kind}; choose another name or call unregister_method({name!r}).")
    if not callable(compute):
        raise TypeError(f"compute must be callable, got {type(compute).__name__}.")
    defaults = {key: value if value is REQUIRED else plain_value(value) for key, value in dict(defaults or {}).items()}
    for key in defaults:
        if not isinstance(key, str) or not key.isidentifier():
            # given as keywords (patch_model(..., key=value)) and as `--param key=value` on command lines
            raise TypeError(
                f"defaults keys are parameter names, so identifier strings such as 'beta_fast'; got {key!r}."
            )
    clash = set(defaults) & set(COMMON_PARAMS)
    if clash:
        raise ValueError(f"defaults must not contain {sorted(clash)}: these are set from scale/max_length.")
    clash = set(defaults) & set(_reserved_keywords())
    if clash:
        raise ValueError(
            f"defaults must not contain {sorted(clash)}: patch_model (or PatchSpec.create, describe_patch, "
            "runtime_settings) takes keywords of these names itself, so the parameter could never be given; rename it."
        )
    for key, value in defaults.items():
        if value is not REQUIRED:
            _check_json(value, f"defaults[{key!r}]")
    if transformers_rope_type is not None and rope_parameters is None:
        rope_parameters = _NATIVE_WRITERS.get(transformers_rope_type)
        if rope_parameters is None:
            raise ValueError(
                f"transformers_rope_type={transformers_rope_type!r} has no built-in writer; pass rope_parameters= "
                f"(a function writing config.rope_parameters) or use one of {sorted(_NATIVE_WRITERS)}."
            )
    runtimes = dict(runtimes or {})
    for runtime, translator in runtimes.items():
        if runtime not in RUNTIMES:
            raise ValueError(f"runtimes has an unknown runtime {runtime!r}; use {' or '.join(map(repr, RUNTIMES))}.")
        if not (callable(translator) or isinstance(translator, str)):
            raise TypeError(f"the {runtime} translator must be callable, got {type(translator).__name__}.")
    method = RopeMethod(
        name=name,
        compute=compute,
        defaults=defaults,
        length_dependent=length_dependent,
        transformers_rope_type=transformers_rope_type,
        summary=summary or _first_line(compute.__doc__),
        validate=validate,
        attention=attention,
        rope_parameters=rope_parameters,
        runtimes=runtimes,
    )
    _REGISTRY[name] = method
    from . import config_io  # imports this module

    try:
        # checkpoints saved with the method then load through from_pretrained in this process
        config_io.register_with_transformers(method)
    except Exception:
        del _REGISTRY[name]
        raise
    return method


def unregister_method(name: str) -> None:
    """Remove a user-registered method. Built-in methods cannot be removed."""
    if name in _BUILTIN:
        raise ValueError(f"{name!r} is a built-in method and cannot be removed.")
    if name not in _REGISTRY:
        raise ValueError(f"No user-registered RoPE method named {name!r}; registered: {sorted(_REGISTRY)}.")
    from . import config_io

    config_io.unregister_from_transformers(_REGISTRY.pop(name))


def list_methods() -> dict[str, str]:
    """All registered methods, name -> one-line summary, built-in ones first."""
    builtin = {name: _REGISTRY[name].summary for name in _REGISTRY if name in _BUILTIN}
    user = {name: _REGISTRY[name].summary for name in _REGISTRY if name not in _BUILTIN}
    return {**builtin, **user}


def is_builtin(name: str) -> bool:
    """True for the methods that ship with the package (they cannot be replaced)."""
    return name in _BUILTIN


_METHOD_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def get_method(name: str) -> RopeMethod:
    """Look up a method; an unknown name raises ``ValueError`` listing the valid ones.

    A ``+logn`` suffix (log-n attention on top of the method, see ``patch_model``) names the
    same method: ``get_method("yarn+logn") is get_method("yarn")``.
    """
    if not isinstance(name, str):
        raise TypeError(f"method must be a string, got {type(name).__name__}; valid methods: {sorted(_REGISTRY)}.")
    if name.endswith(LOGN_SUFFIX) and name != LOGN_SUFFIX:
        name = name[: -len(LOGN_SUFFIX)]
        if name.endswith(LOGN_SUFFIX):
            raise ValueError(f"method {name + LOGN_SUFFIX!r} repeats the {LOGN_SUFFIX!r} suffix; give it once.")
    if name == "auto":
        raise ValueError(
            "'auto' is not a method but a choice among them: patch_model(model, scale, method='auto', "
            "calibration_ids=...) or `hf-rope-ext auto` measures candidates and names the best; use that name here."
        )
    try:
        return _REGISTRY[name]
    except KeyError:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"Unknown RoPE method {name!r}.{hint} Valid methods: {', '.join(_REGISTRY)}.") from None


def resolve_params(method: RopeMethod, rotary_dim: int | None, user_params: Mapping[str, Any]) -> dict[str, Any]:
    """Fill in defaults, reject unknown or misspelled keys and bad values; returns a new dict.

    The method's own check (``validate``) needs the rotary dimension and is skipped without it."""
    unknown = [key for key in user_params if key not in method.defaults]
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, list(method.defaults) + list(_patch_keywords()), n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        valid = ", ".join(method.defaults) or "none"
        raise ValueError(
            f"Unknown parameter(s) for method {method.name!r}: {', '.join(hints)}. "
            f"Parameters this method accepts: {valid}."
        )
    params = dict(method.defaults)
    params.update({key: plain_value(value) for key, value in user_params.items()})
    missing = [key for key, value in params.items() if value is REQUIRED]
    if missing:
        raise ValueError(f"Method {method.name!r} needs parameter(s) {missing}; pass them to patch_model.")
    for key, default in method.defaults.items():
        value = params[key]
        if is_real(default) and not (is_real(value) and math.isfinite(value)):
            raise TypeError(f"Parameter {key!r} of method {method.name!r} must be a finite number, got {value!r}.")
        if isinstance(default, bool) and not isinstance(value, bool):
            raise TypeError(f"Parameter {key!r} of method {method.name!r} must be True or False, got {value!r}.")
    if method.validate is not None and rotary_dim is not None:  # None: checked once the model is known
        try:
            method.validate(rotary_dim, params)
        except (OverflowError, ZeroDivisionError) as error:  # finite but absurd values (1e308)
            raise ValueError(f"Parameters of method {method.name!r} are out of range ({error}): {params}.") from None
    for key, value in params.items():  # the patch record (config.json) must hold them
        _check_json(value, f"Parameter {key!r} of method {method.name!r}")
    return params


def _check_json(value: Any, what: str) -> None:
    """Refuse a value the patch record (config.json) could not hold: it must be plain JSON."""

    def plain(item: Any) -> bool:
        if item is None or type(item) in (bool, int, float, str):
            return True
        if type(item) is list:
            return all(plain(element) for element in item)
        if type(item) is dict:
            return all(type(key) is str and plain(element) for key, element in item.items())
        return False

    if not plain(value):
        raise TypeError(
            f"{what} must be a JSON value (a number, string, bool, None, or a list or str-keyed dict of them), "
            f"got {type(value).__name__} {value!r:.80}."
        )


def plain_value(value: Any) -> Any:
    """``value`` as plain Python: numpy and torch scalars become ``int``/``float``/``bool``,
    arrays, tensors and tuples become lists of those (so a patch can be written as JSON), and
    -0.0 becomes 0.0 (the same patch gives the same config)."""
    if type(value) is float:
        return value + 0.0  # -0.0 + 0.0 == +0.0
    if type(value) in (bool, int, str) or value is None:
        return value
    if isinstance(value, torch.Tensor) or type(value).__module__ == "numpy":  # scalars and arrays alike
        return plain_value(value.tolist()) if hasattr(value, "tolist") else value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value) + 0.0
    if isinstance(value, (list, tuple)):
        return [plain_value(item) for item in value]
    if isinstance(value, Mapping):
        return {key: plain_value(item) for key, item in value.items()}
    return value


def _keywords_of(*functions: Callable[..., Any]) -> tuple[str, ...]:
    names = (parameter.name for function in functions for parameter in inspect.signature(function).parameters.values()
             if parameter.kind is not parameter.VAR_KEYWORD)  # fmt: skip
    return tuple(dict.fromkeys(names))


@functools.cache
def _patch_keywords() -> tuple[str, ...]:
    """patch_model's own keywords (scale, method, ...), for "did you mean" hints on misspelled parameters."""
    from .patching import patch_model  # patching imports this module

    return tuple(name for name in _keywords_of(patch_model) if name != "model")


@functools.cache
def _reserved_keywords() -> tuple[str, ...]:
    """The keywords of the public functions that also take a method's parameters as ``**params``
    (or pass them on to one that does): a method parameter of one of these names could not be
    passed to them."""
    from .patching import patch_model, patched
    from .runtimes import describe_patch, runtime_settings
    from .spec import PatchSpec

    # create's underlying function: the classmethod's signature hides `cls`, which
    # PatchSpec.create(..., cls=2) (and patch_model, through it) still refuses as given twice
    return _keywords_of(patch_model, patched, PatchSpec.create.__func__, describe_patch, runtime_settings)


def _attention():
    from . import attention  # imports transformers' attention registries; only needed when patching

    return attention


def _register_builtin(method: RopeMethod) -> None:
    _REGISTRY[method.name] = method
    _BUILTIN.add(method.name)


for _method in (
    RopeMethod(
        "linear",
        linear_inv_freq,
        transformers_rope_type="linear",
        rope_parameters=_NATIVE_WRITERS["linear"],
        runtimes=_builtin_runtimes("linear"),
        summary="Position Interpolation: theta_i / s. Best after fine-tuning; costs perplexity without it.",
    ),
    RopeMethod(
        "ntk",
        ntk_inv_freq,
        transformers_rope_type="default",
        rope_parameters=_NATIVE_WRITERS["default"],
        runtimes=_builtin_runtimes("ntk"),
        summary="Static NTK-aware: rope_theta * s^(d/(d-2)). Plain RoPE with a larger base; loads anywhere.",
    ),
    RopeMethod(
        "dynamic",
        dynamic_ntk_inv_freq,
        length_dependent=True,
        transformers_rope_type="dynamic",
        rope_parameters=_NATIVE_WRITERS["dynamic"],
        runtimes=_builtin_runtimes("dynamic"),
        summary="Dynamic NTK: base grows with the current length; unchanged inside the original context.",
    ),
    RopeMethod(
        "yarn",
        yarn_inv_freq,
        defaults=_YARN_DEFAULTS,
        transformers_rope_type="yarn",
        rope_parameters=_NATIVE_WRITERS["yarn"],
        runtimes=_builtin_runtimes("yarn"),
        summary="YaRN: NTK-by-parts ramp plus attention temperature 0.1 ln(s) + 1.",
        validate=_check_betas,
    ),
    RopeMethod(
        "dynamic-yarn",
        dynamic_yarn_inv_freq,
        defaults=_YARN_DEFAULTS,
        length_dependent=True,
        summary="YaRN with scale max(1, L/L0) following the current length; exact original inside L0.",
        runtimes=_builtin_runtimes("dynamic-yarn"),
        validate=_check_betas,
    ),
    RopeMethod(
        "dynamic-linear",
        dynamic_linear_inv_freq,
        length_dependent=True,
        summary="Position Interpolation with scale max(1, L/L0) following the current length.",
        runtimes=_builtin_runtimes("dynamic-linear"),
    ),
    RopeMethod(
        "llama3",
        llama3_inv_freq,
        defaults={"low_freq_factor": 1.0, "high_freq_factor": 4.0},
        transformers_rope_type="llama3",
        rope_parameters=_NATIVE_WRITERS["llama3"],
        runtimes=_builtin_runtimes("llama3"),
        summary="Llama 3.1 band interpolation: short wavelengths kept, long ones / s, smooth between.",
        validate=_check_llama3,
    ),
    RopeMethod(
        "longrope",
        longrope_inv_freq,
        defaults={"long_factor": REQUIRED, "short_factor": None, "attention_factor": None},
        length_dependent=True,
        transformers_rope_type="longrope",
        rope_parameters=_NATIVE_WRITERS["longrope"],
        runtimes=_builtin_runtimes("longrope"),
        summary="LongRoPE with given per-dimension factors (long beyond L0, short inside).",
        validate=_check_longrope,
    ),
    RopeMethod(
        "self-extend",
        attention_level_inv_freq,
        defaults={"group_size": None, "neighbor_window": None, "far_positions": "grouped", "frequencies": None,
                  "frequencies_scale": None},
        validate=_check_frequencies,
        summary="Self-Extend: trained positions within a neighbour window, grouped (floor(p/G)) positions beyond.",
        attention=lambda params: _attention().self_extend_remap(params),
        runtimes=_builtin_runtimes("self-extend"),
    ),
    RopeMethod(
        "dual-chunk",
        attention_level_inv_freq,
        defaults={"chunk_size": None, "local_window": None, "frequencies": None, "frequencies_scale": None},
        validate=_check_frequencies,
        summary="Dual Chunk Attention: intra-, successive- and inter-chunk positions, all within the trained context.",
        attention=lambda params: _attention().dual_chunk_remap(params),
        runtimes=_builtin_runtimes("dual-chunk"),
    ),
    RopeMethod(
        "dynamic-yarn-dca",
        dynamic_yarn_dca_inv_freq,
        defaults={**_YARN_DEFAULTS, "frequencies_scale": 2.0, "chunk_size": None, "local_window": None},
        length_dependent=True,
        validate=_check_dynamic_yarn_dca,
        summary="dynamic-yarn up to frequencies_scale x L0 (default 2), then yarn at that scale under Dual Chunk Attention.",
        attention=lambda params: _attention().dual_chunk_remap(params, "dynamic-yarn-dca"),
        settle_length=_dynamic_yarn_dca_settle_length,
        runtimes=_builtin_runtimes("dynamic-yarn-dca"),
    ),
    RopeMethod(
        "self-extend-dca",
        self_extend_dca_inv_freq,
        defaults={**_YARN_DEFAULTS, "frequencies_scale": 2.0, "neighbor_window": None, "chunk_size": None,
                  "local_window": None},
        length_dependent=True,
        validate=_check_dynamic_yarn_dca,  # the remaps check their own parameters when patching
        summary="self-extend (by-parts far positions) on the trained frequencies up to frequencies_scale x L0 "
                "(default 2), then yarn at that scale under Dual Chunk Attention.",
        attention=lambda params: _attention().dual_chunk_remap(params, "self-extend-dca"),
        attention_below_settle=_self_extend_below_settle,
        settle_length=_dynamic_yarn_dca_settle_length,
        runtimes=_builtin_runtimes("self-extend-dca"),
    ),
    RopeMethod(
        "self-extend-yarn",
        self_extend_yarn_inv_freq,
        defaults={**_YARN_DEFAULTS, "frequencies_scale": 2.0, "neighbor_window": None},
        length_dependent=True,
        validate=_check_dynamic_yarn_dca,  # the remap checks its own parameters when patching
        summary="self-extend (by-parts far positions) at every length, on the trained frequencies up to "
                "frequencies_scale x L0 (default 2) and on yarn at that scale beyond.",
        attention=lambda params: _self_extend_by_parts(params, "self-extend-yarn"),
        attention_below_settle=lambda params: _self_extend_by_parts(params, "self-extend-yarn"),
        settle_length=_dynamic_yarn_dca_settle_length,
        runtimes=_builtin_runtimes("self-extend-yarn"),
    ),
):
    _register_builtin(_method)
