"""Swap a loaded model's rotary embedding for a scaled one, in place, and give it back.

Only the model instance changes: one submodule is replaced (the original is kept for
:func:`unpatch_model`), ``model.config`` is updated in place, and length-dependent methods add
two forward hooks on the module that calls the rotary embedding. No class or module-level
function of transformers is touched.
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import compat, config_io
from .families import family_info, tested_families
from .methods import LOGN_SUFFIX, default_inv_freq, get_method, resolve_params
from .cache_consistency import PrefixRecompute
from .rotary import ExtendedRotaryEmbedding

logger = logging.getLogger(__name__)

DEFAULT_METHOD = "dynamic-yarn"
# Length-dependent methods use the frequencies of the exact (planned) length by default: a
# forward over L tokens those of L, generate those of prompt + max_new_tokens, chosen once
# before the prefill, so generation recomputes nothing (README, "Speed"). An integer n rounds
# every length up to L0 * 2 ** (k / n) instead (fewer recomputations in decode loops that
# announce no plan, at some cost in quality).
DEFAULT_STEPS_PER_DOUBLING = None

_UNSET: Any = object()  # "argument not given", where None is a meaningful value


@dataclass(frozen=True)
class PatchInfo:
    """What :func:`get_patch_info` reports about a patched model.

    ``max_position_embeddings`` is the context the patch targets (original x scale), also for
    length-dependent methods, whose config keeps the original value (see ``config_io``).
    """

    method: str
    scale: float
    original_max_position_embeddings: int
    max_position_embeddings: int
    params: dict[str, Any] = field(default_factory=dict)
    steps_per_doubling: int | None = None
    module_name: str = ""
    logn_attention: bool = False


def _model_type(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None) or type(model).__name__


def _patched_modules(model: nn.Module) -> list[tuple[str, ExtendedRotaryEmbedding]]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"Expected a torch.nn.Module (a transformers model), got {type(model).__name__}.")
    return [(name, module) for name, module in model.named_modules() if isinstance(module, ExtendedRotaryEmbedding)]


def find_rotary_module(model: nn.Module) -> tuple[str, nn.Module]:
    """The model's rotary embedding, found by structure: a submodule with an ``inv_freq`` tensor.

    Raises ``ValueError`` naming the model type when there is none or more than one.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch_model expects a torch.nn.Module (a transformers model), got {type(model).__name__}.")
    model_type = _model_type(model)
    info = family_info(model_type)
    if info is not None and not info.supported:
        raise ValueError(
            f"model_type {model_type!r} is not supported: {info.note}. hf_rope_ext works on RoPE models "
            f"with a shared rotary module, such as {', '.join(tested_families())}."
        )
    candidates = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(getattr(module, "inv_freq", None), torch.Tensor) and not isinstance(module, ExtendedRotaryEmbedding)
    ]
    if not candidates:
        raise ValueError(
            f"model_type {model_type!r} has no rotary position embedding module (a submodule with an "
            "`inv_freq` buffer that the model calls once per forward), so there is nothing to scale. "
            f"hf_rope_ext works on RoPE models such as {', '.join(tested_families())}."
        )
    if len(candidates) > 1:
        names = ", ".join(name for name, _ in candidates)
        raise ValueError(
            f"model_type {model_type!r} has {len(candidates)} rotary modules ({names}); hf_rope_ext supports "
            "models with one rotary embedding shared by all layers."
        )
    return candidates[0]


def _check_scale(scale: Any, name: str = "scale") -> float:
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"{name} must be a number (e.g. {name}=4), got {type(scale).__name__} {scale!r}.")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"{name} must be finite, got {scale}.")
    if scale <= 0:
        raise ValueError(f"{name} must be > 1 (how many times longer than the original context), got {scale}.")
    if scale < 1:
        raise ValueError(
            f"{name}={scale} is below 1, which would shrink the context the model handles; "
            "hf_rope_ext only extends. Use scale > 1 (e.g. 2, 4, 8)."
        )
    if scale == 1:
        raise ValueError(f"{name}=1 leaves the model unchanged; use scale > 1 (e.g. 2, 4, 8).")
    return scale


def _check_length(value: Any, name: str, what: str = "number of tokens") -> int:
    """``value`` as a positive int; the errors say it is a positive integer ``what``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if isinstance(value, float) and value.is_integer():
            return _check_length(int(value), name, what)
        raise TypeError(f"{name} must be a positive integer {what}, got {value!r}.")
    if value <= 0:
        raise ValueError(f"{name} must be a positive {what}, got {value}.")
    return int(value)


def _check_steps(value: Any) -> int | None:
    """``steps_per_doubling``: a positive integer, or None (the exact length)."""
    if value is None:
        return None
    return _check_length(value, "steps_per_doubling", "number of frequency steps per doubling of the length (or None)")


def whole_token_scale(scale: float, original_length: int) -> float:
    """The scale, rounded so that the extended context ``L0 * scale`` is a whole number of tokens.

    The rule: the extended context is ``L0 * scale`` rounded to the nearest token, and the scale
    becomes ``extended / L0`` (so ``factor`` and ``max_position_embeddings / L0`` agree, as
    transformers checks). A warning says when this changes the scale by more than float
    rounding. A scale that extends the context by less than half a token is refused.
    """
    target = original_length * scale
    extended = int(math.floor(target + 0.5))
    if extended <= original_length:
        raise ValueError(
            f"scale={scale!r} extends the original context of {original_length} tokens by "
            f"{target - original_length:.3g} tokens, less than half a token; the smallest extension is "
            f"scale={(original_length + 1) / original_length!r} (max_length={original_length + 1})."
        )
    whole = extended / original_length
    if not math.isclose(whole, scale, rel_tol=1e-9):
        logger.warning(
            "scale %r gives %.6g tokens over the original %d; using scale %r (%d tokens) so that the extended context "
            "is a whole number of tokens.", scale, target, original_length, whole, extended,
        )  # fmt: skip
    return whole


def resolve_scale(scale: Any, max_length: Any, original_length: int) -> float:
    """The scale of a patch from ``scale`` or ``max_length`` (exactly one), checked and rounded so
    that ``original_length * scale`` is a whole number of tokens (see :func:`whole_token_scale`).
    Every entry point (patching, fine-tuning, runtime settings) resolves its target through this."""
    if scale is not None and max_length is not None:
        raise ValueError(
            f"Give either scale or max_length, not both (got scale={scale!r}, max_length={max_length!r}); "
            "scale = max_length / original context."
        )
    if scale is None and max_length is None:
        raise ValueError("patch_model needs scale= (e.g. scale=4) or max_length= (the context you want, in tokens).")
    if max_length is not None:
        max_length = _check_length(max_length, "max_length")
        if max_length <= original_length:
            raise ValueError(
                f"max_length={max_length} is not beyond the model's original context of {original_length} tokens; "
                "nothing to extend."
            )
        return _check_scale(max_length / original_length, "max_length / original context")
    return whole_token_scale(_check_scale(scale), original_length)


def original_context_length(config: Any, original_max_length: Any = None) -> int:
    """The context the model was trained on: ``original_max_length`` if given, else the config's
    ``max_position_embeddings``."""
    if original_max_length is not None:
        return _check_length(original_max_length, "original_max_length")
    value = getattr(config, "max_position_embeddings", None)
    if value is None:
        raise ValueError(
            f"model_type {getattr(config, 'model_type', '?')!r}: the config has no max_position_embeddings, so the "
            "original context length is unknown; pass original_max_length= (the context the model was trained on)."
        )
    return _check_length(value, "config.max_position_embeddings")


# A model cast to fp16/bf16 (and perhaps back) carries frequencies rounded to that dtype, so they
# are compared within the coarser rounding of the two: bfloat16's relative eps, and fp16's
# subnormal spacing for tiny frequencies. Other layouts differ far more (scaled, other base,
# partial or interleaved rotation).
_FREQUENCY_RTOL = torch.finfo(torch.bfloat16).eps
_FREQUENCY_ATOL = torch.finfo(torch.float16).tiny * torch.finfo(torch.float16).eps


def _verify_layout(module: nn.Module, rotary_dim: int, base: float, model_type: str) -> None:
    """Check that the module computes plain RoPE as ``cat(freqs, freqs)`` from ``rope_theta``.

    ``model.half()`` / ``model.to(torch.bfloat16)`` round the module's frequency buffers, so they
    are compared within that rounding; the patch rebuilds them from ``rope_theta`` in full precision.
    """
    original = getattr(module, "original_inv_freq", module.inv_freq).detach().double().cpu()
    expected = default_inv_freq(rotary_dim, base)
    if original.shape != expected.shape or not torch.allclose(
        original, expected, rtol=_FREQUENCY_RTOL, atol=_FREQUENCY_ATOL
    ):
        raise ValueError(
            f"model_type {model_type!r}: the rotary module's frequencies are not plain RoPE with "
            f"rope_theta={base} over {rotary_dim} dimensions; this layout is not supported."
        )
    device = module.inv_freq.device
    probe = torch.zeros(1, dtype=torch.float32, device=device)
    positions = torch.arange(8, device=device)[None]
    try:
        with torch.no_grad():
            cos, sin = module(probe, positions)
    except TypeError as error:
        raise ValueError(
            f"model_type {model_type!r}: its rotary module is not called as forward(x, position_ids) "
            f"({error}); this layout is not supported."
        ) from error
    angles = positions[..., None].double() * expected.to(device)
    reference = torch.cat((angles, angles), dim=-1)
    # Angles up to 7 * inv_freq (<= 7 rad): their error is at most 7 times the frequencies' rounding.
    tolerance = 1e-5 + 8 * _FREQUENCY_RTOL
    if cos.shape[-1] != rotary_dim or not torch.allclose(cos.double(), reference.cos(), atol=tolerance):
        raise ValueError(
            f"model_type {model_type!r}: its rotary module does not return cos/sin laid out as cat(freqs, freqs) "
            "(rotate-half); interleaved or other layouts are not supported."
        )


def split_method_spec(method: Any, logn_attention: Any = False) -> tuple[Any, bool]:
    """``"yarn+logn"`` -> ``("yarn", True)``: the method name and whether log-n attention is on."""
    if not isinstance(logn_attention, bool):
        raise TypeError(f"logn_attention must be True or False, got {logn_attention!r}.")
    if isinstance(method, str) and method.endswith(LOGN_SUFFIX):
        return method[: -len(LOGN_SUFFIX)], True
    return method, logn_attention


def method_spec(method: str, logn_attention: bool) -> str:
    """The inverse of :func:`split_method_spec`."""
    return method + LOGN_SUFFIX if logn_attention else method


def _caller_and_attribute(model: nn.Module, module_name: str) -> tuple[nn.Module, str]:
    parent_name, _, attribute = module_name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), attribute


def patch_model(
    model: nn.Module,
    scale: float | None = None,
    method: str = DEFAULT_METHOD,
    *,
    max_length: int | None = None,
    original_max_length: int | None = None,
    steps_per_doubling: Any = _UNSET,
    logn_attention: bool = False,
    **params: Any,
) -> nn.Module:
    """Extend the context of a loaded RoPE model in place; returns the same model.

    Args:
        model: a transformers ``*ForCausalLM``, its base model, or a peft wrapper of either.
        scale: how many times the original context to reach (> 1), rounded so that the
            extended context is a whole number of tokens (:func:`whole_token_scale`). Or give
            ``max_length``.
        method: a registered method (see :func:`hf_rope_ext.list_methods`); default
            ``"dynamic-yarn"``.
        max_length: target context in tokens; ``scale = max_length / original context``.
        original_max_length: the context the model was trained on; defaults to
            ``config.max_position_embeddings``.
        steps_per_doubling: length-dependent methods only. Default ``None``: the frequencies
            of the exact length (a forward over L tokens uses those of L, as transformers'
            ``dynamic`` does; ``generate`` those of prompt + ``max_new_tokens``, chosen before
            the prefill, so the KV cache is never recomputed within a call). An integer n
            rounds every such length beyond the original context ``L0`` up to the next
            ``L0 * 2 ** (k / n)``: a decode loop that announces no final length (see
            :func:`hf_rope_ext.planned_length`) then recomputes the cache at most n times per
            doubling instead of at every token past the length it was filled for.
        logn_attention: multiply the attention logits of the query at position ``i`` by
            ``max(1, ln(i + 1) / ln(L0))`` (log-n attention temperature), with any method.
            Also spelled as a ``+logn`` suffix of the method name (``"self-extend+logn"``).
        **params: the method's own parameters (e.g. ``beta_fast=32`` for yarn; ``group_size``
            and ``neighbor_window`` for self-extend; ``chunk_size`` and ``local_window`` for
            dual-chunk).

    The model's config is updated to describe the patch (see :mod:`hf_rope_ext.config_io`).
    Patching an already patched model starts again from the original: scales never compound.
    """
    if _patched_modules(model):
        unpatch_model(model)
    model_config = getattr(model, "config", None)
    if model_config is not None and getattr(model_config, "rope_parameters", None):
        compat.rope_parameters(model_config)  # clear error for per-layer-type RoPE before searching modules
    module_name, original = find_rotary_module(model)
    model_type = _model_type(model)
    config = getattr(original, "config", None) or getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no config; patch a transformers model.")
    rope = compat.rope_parameters(config)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(
            f"model_type {model_type!r} already uses RoPE scaling (rope_type={rope_type!r} in its config); "
            "hf_rope_ext extends models that use plain RoPE. Load the model without that scaling first."
        )
    base = float(rope["rope_theta"])
    rotary_dim = 2 * original.inv_freq.shape[-1]
    _verify_layout(original, rotary_dim, base, model_type)

    original_length = original_context_length(config, original_max_length)
    scale = resolve_scale(scale, max_length, original_length)
    method, logn_attention = split_method_spec(method, logn_attention)
    rope_method = get_method(method)
    resolved = resolve_params(rope_method, rotary_dim, params)
    resolved["factor"] = scale
    resolved["original_max_position_embeddings"] = original_length
    remap = rope_method.attention(resolved) if rope_method.attention is not None else None
    if rope_method.length_dependent:
        if steps_per_doubling is _UNSET:
            steps_per_doubling = DEFAULT_STEPS_PER_DOUBLING
        else:
            steps_per_doubling = _check_steps(steps_per_doubling)
    elif steps_per_doubling is not _UNSET:
        raise ValueError(f"steps_per_doubling only applies to length-dependent methods; {method!r} is static.")
    else:
        steps_per_doubling = None

    rotary = ExtendedRotaryEmbedding(original, rope_method, resolved, rotary_dim, base, steps_per_doubling)
    extended = config_io.extended_length(original_length, scale)
    inv_freq, attention = rotary.frequencies(extended)
    unchanged = torch.allclose(inv_freq, default_inv_freq(rotary_dim, base), rtol=1e-9, atol=0) and attention == 1.0
    if unchanged and remap is None and not logn_attention:
        raise ValueError(
            f"method {method!r} with {params or 'default parameters'} leaves the frequencies unchanged at "
            f"{extended} tokens: the patch would do nothing. Check the method's parameters."
        )

    kept = {key: rope[key] for key in ("partial_rotary_factor",) if key in rope}
    new_rope, max_positions = config_io.rope_config_for(rope_method, resolved, base, rotary_dim, kept)
    # Phi-3 configs also hold the trained context at the top level, and transformers takes it over
    # rope_parameters' (its class default, 4096, often differs): it must say L0 as well.
    top_level = ("original_max_position_embeddings",) if hasattr(config, "original_max_position_embeddings") else ()
    rotary._saved_config = compat.snapshot_config(config, (config_io.RECORD_ATTRIBUTE, *top_level))
    try:
        if top_level:
            config.original_max_position_embeddings = original_length
        compat.write_rope_config(config, new_rope, max_positions)
    except Exception:
        compat.restore_config(config, rotary._saved_config)
        raise
    record = config_io.patch_record(rope_method, resolved, base, steps_per_doubling)
    if logn_attention:
        record["logn_attention"] = True
    setattr(config, config_io.RECORD_ATTRIBUTE, record)

    caller, attribute = _caller_and_attribute(model, module_name)
    try:
        rotary.cache_guard = PrefixRecompute(caller, rotary, model) if rope_method.length_dependent else None
        if remap is not None or logn_attention:
            from . import attention as attention_level

            rotary.attention_patch = attention_level.install(config, remap, inv_freq, original_length, logn_attention)
    except Exception:
        if rotary.cache_guard is not None:
            rotary.cache_guard.remove()
        compat.restore_config(config, rotary._saved_config)
        raise
    setattr(caller, attribute, rotary)
    logger.info(
        "Patched %s (%s) with %s, scale %g: context %d -> %d tokens.",
        module_name,
        model_type,
        rope_method.name,
        scale,
        original_length,
        extended,
    )
    return model


def unpatch_model(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_model`: the original rotary module, config and no hooks. Returns the model."""
    patched = _patched_modules(model)
    if not patched:
        raise ValueError(f"{type(model).__name__} is not patched by hf_rope_ext; nothing to undo.")
    for module_name, rotary in patched:
        if rotary.cache_guard is not None:
            rotary.cache_guard.remove()
        if rotary.attention_patch is not None:
            from . import attention as attention_level

            attention_level.uninstall(rotary.attention_patch)
        original = rotary.original_rotary
        compat.restore_config(rotary.config if rotary.config is not None else model.config, rotary._saved_config)
        caller, attribute = _caller_and_attribute(model, module_name)
        setattr(caller, attribute, original)
        logger.info("Restored the original rotary embedding at %s.", module_name)
    return model


def get_patch_info(model: nn.Module) -> PatchInfo | None:
    """How ``model`` is patched, or None if it is not."""
    patched = _patched_modules(model)
    if not patched:
        return None
    module_name, rotary = patched[0]
    params = {key: value for key, value in rotary.params.items() if key not in ("factor", "original_max_position_embeddings")}
    return PatchInfo(
        method=rotary.method.name,
        scale=rotary.params["factor"],
        original_max_position_embeddings=rotary.original_max_seq_len,
        max_position_embeddings=config_io.extended_length(rotary.original_max_seq_len, rotary.params["factor"]),
        params=params,
        steps_per_doubling=rotary.steps_per_doubling,
        module_name=module_name,
        logn_attention=rotary.attention_patch is not None and rotary.attention_patch.logn,
    )


@contextlib.contextmanager
def patched(model: nn.Module, scale: float | None = None, method: str = DEFAULT_METHOD, **kwargs: Any) -> Iterator[nn.Module]:
    """Context manager form of :func:`patch_model`: on exit the model is as it was before,
    including a patch it already had."""
    previous = get_patch_info(model)
    patch_model(model, scale, method, **kwargs)
    try:
        yield model
    finally:
        unpatch_model(model)
        if previous is not None:
            patch_model(
                model,
                previous.scale,
                previous.method,
                original_max_length=previous.original_max_position_embeddings,
                steps_per_doubling=(
                    previous.steps_per_doubling if get_method(previous.method).length_dependent else _UNSET
                ),
                logn_attention=previous.logn_attention,
                **previous.params,
            )
