"""Swap a loaded model's rotary embedding for a scaled one, in place, and give it back.

Only the model instance changes: one submodule is replaced (the original is kept for
:func:`unpatch_model`), the model gets its own copy of its config, which describes the patch
(another model built from the same config object is not affected; unpatching puts the original
object back), and length-dependent methods add two forward hooks on the module that calls the
rotary embedding. No class or module-level function of transformers is touched.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import logging
import numbers
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from . import compat, config_io
from .cache_consistency import CacheRecord, PrefixRecompute
from .families import check_supported, tested_families
from .forward_threads import ForwardThreads
from .methods import default_inv_freq, get_method, list_methods
from .rotary import ExtendedRotaryEmbedding, attention_dropout_message
from .spec import (
    DEFAULT_STEPS_PER_DOUBLING,
    NOT_GIVEN,
    PatchSpec,
    method_spec,
    resolve_scale,
    split_method_spec,
    whole_token_scale,
)
from .validation import check_length, is_real

logger = logging.getLogger(__name__)

__all__ = [
    "AUTO_METHOD",
    "DEFAULT_METHOD",
    "DEFAULT_STEPS_PER_DOUBLING",
    "PatchInfo",
    "apply_spec",
    "find_rotary_module",
    "get_patch_info",
    "method_spec",
    "original_context_length",
    "owner_and_attribute",
    "patch_model",
    "patched",
    "resolve_scale",
    "split_method_spec",
    "unpatch_model",
    "whole_token_scale",
]

# Measured best across 4k-64k on SmolLM2 (README, "Results: attention-level methods"): the
# unpatched model inside L0, Self-Extend (by-parts far positions) on the trained frequencies up
# to 2x and on YaRN x2 beyond.
DEFAULT_METHOD = "self-extend-yarn"
# Not a registered method: patch_model measures candidates and applies the best (hf_rope_ext.auto).
AUTO_METHOD = "auto"

# What get_patch_info returns: the one patch type (hf_rope_ext.spec.PatchSpec), under its old name.
PatchInfo = PatchSpec


def _model_type(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None) or type(model).__name__


def _check_is_model(model: Any, function: str) -> None:
    """Refuse what is not a model: a non-module, or the rotary module itself (patched or not),
    which would be replaced inside itself."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{function} expects a torch.nn.Module (a transformers model), got {type(model).__name__}.")
    if isinstance(model, ExtendedRotaryEmbedding) or isinstance(getattr(model, "inv_freq", None), torch.Tensor):
        raise ValueError(
            f"{function} expects the model (e.g. LlamaForCausalLM or its .model), not its rotary embedding module "
            f"({type(model).__name__}); pass the model that holds it."
        )


def _check_no_prefix_tuning(model: nn.Module, function: str) -> None:
    """Refuse a peft model with prefix tuning: its virtual key/values come into every forward as a
    KV cache the patch did not fill, which each patched forward refuses."""
    peft_config = getattr(model, "peft_config", None)
    for name, config in (peft_config.items() if isinstance(peft_config, dict) else ()):
        peft_type = getattr(config, "peft_type", None)
        if str(getattr(peft_type, "value", peft_type)) == "PREFIX_TUNING":
            raise ValueError(
                f"{function}: adapter {name!r} is peft prefix tuning, whose virtual key/values enter every forward as "
                "a KV cache filled without the patch, which patched models do not support; use LoRA or prompt tuning."
            )


def _patched_modules(model: nn.Module, function: str = "hf_rope_ext") -> list[tuple[str, ExtendedRotaryEmbedding]]:
    _check_is_model(model, function)
    return [(name, module) for name, module in model.named_modules() if isinstance(module, ExtendedRotaryEmbedding)]


def find_rotary_module(model: nn.Module) -> tuple[str, nn.Module]:
    """The model's rotary embedding, found by structure: a submodule with an ``inv_freq`` tensor.

    Raises ``ValueError`` naming the model type when there is none or more than one.
    """
    _check_is_model(model, "patch_model")
    model_type = _model_type(model)
    check_supported(model_type, getattr(model, "config", None))
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
        if any("modules_to_save" in name for name, _ in candidates):  # peft's copy of a wrapped module
            raise ValueError(
                f"model_type {model_type!r}: peft's modules_to_save holds the rotary module ({names}); leave it out "
                "of modules_to_save (it has no weights to train)."
            )
        raise ValueError(
            f"model_type {model_type!r} has {len(candidates)} rotary modules ({names}); hf_rope_ext supports "
            "models with one rotary embedding shared by all layers."
        )
    return candidates[0]


def original_context_length(config: Any, original_max_length: Any = None) -> int:
    """The context the model was trained on: ``original_max_length`` if given, else the config's
    ``max_position_embeddings``."""
    if original_max_length is not None:
        return check_length(original_max_length, "original_max_length")
    value = getattr(config, "max_position_embeddings", None)
    if value is None:
        raise ValueError(
            f"model_type {getattr(config, 'model_type', '?')!r}: the config has no max_position_embeddings, so the "
            "original context length is unknown; pass original_max_length= (the context the model was trained on)."
        )
    return check_length(value, "config.max_position_embeddings")


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


def owner_and_attribute(model: nn.Module, module_name: str) -> tuple[nn.Module, str]:
    """The module holding submodule ``module_name`` and the attribute it is held under."""
    parent_name, _, attribute = module_name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), attribute


def patch_model(
    model: nn.Module,
    scale: float | None = None,
    method: str = DEFAULT_METHOD,
    *,
    max_length: int | None = None,
    original_max_length: int | None = None,
    steps_per_doubling: Any = NOT_GIVEN,
    logn_attention: bool | None = None,
    **params: Any,
) -> nn.Module:
    """Extend the context of a loaded RoPE model in place; returns the same model.

    Args:
        model: a transformers ``*ForCausalLM``, its base model, or a peft wrapper of either.
        scale: how many times the original context to reach (> 1), rounded so that the
            extended context is a whole number of tokens (:func:`whole_token_scale`). Or give
            ``max_length``.
        method: a registered method (see :func:`hf_rope_ext.list_methods`); default
            ``"self-extend-yarn"`` (needs attn_implementation sdpa, eager or flash attention).
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
            Also spelled as a ``+logn`` suffix of the method name (``"self-extend+logn"``);
            the suffix with ``logn_attention=False`` is refused. Default (None): off.
        **params: the method's own parameters (e.g. ``beta_fast=32`` for yarn; ``group_size``,
            ``neighbor_window`` and ``far_positions`` (``"grouped"`` or ``"by-parts"``) for
            self-extend; ``chunk_size`` and ``local_window`` for dual-chunk).

    ``method="auto"`` measures candidate configurations on a calibration text and applies the
    best (:mod:`hf_rope_ext.auto`); it takes ``calibration_ids`` (required), ``candidates``,
    ``objective``, ``calibration_length``, ``cache``, ``cache_path`` and ``progress`` (as
    :func:`hf_rope_ext.auto.choose_configuration`) instead of method parameters, and the
    patch it leaves (``get_patch_info``, saved configs) names the method it chose.

    The model gets its own copy of its config, updated to describe the patch (see
    :mod:`hf_rope_ext.config_io`); a config object it shares with another model is left as it
    was, and :func:`unpatch_model` puts it back. Copies of the config that the model's own modules
    hold (a decoder layer in peft's ``modules_to_save``) take the patched config too, and get their
    own back on unpatching. A peft model with prefix tuning is refused (its virtual key/values come
    in as a KV cache the patch did not fill).
    Patching an already patched model starts again from the original: scales never compound.
    Like :func:`unpatch_model`, that is refused while a call of the model is under way.
    """
    _check_is_model(model, "patch_model")
    _check_no_prefix_tuning(model, "patch_model")
    # before auto's calibration: the re-patch after it would be refused
    _check_no_call_under_way(_patched_modules(model, "patch_model"), "patch_model")
    if isinstance(method, str) and method == AUTO_METHOD:
        with _keeping_the_patch_on_error(model):
            return _patch_auto(model, scale, max_length, original_max_length, steps_per_doubling, logn_attention, params)
    with _keeping_the_patch_on_error(model):
        target = _rotary_target(model)
        original_length = original_context_length(target.config, original_max_length)
        spec = PatchSpec.create(
            method,
            scale,
            max_length=max_length,
            original_max_length=original_length,
            steps_per_doubling=steps_per_doubling,
            logn_attention=logn_attention,
            rope_theta=target.base,
            rotary_dim=target.rotary_dim,
            kept=target.kept,
            **params,
        )
        _install(model, target, spec)
    return model


@contextlib.contextmanager
def _keeping_the_patch_on_error(model: nn.Module) -> Iterator[None]:
    """Re-patching starts from the original model; if the new patch is refused (a bad scale or
    parameter, checked only then), the model gets its previous patch back, not none."""
    previous = _patch_to_put_back(model)
    try:
        yield
    except BaseException:
        if previous is not None and not _patched_modules(model):
            _install(model, _rotary_target(model), previous.spec, restoring=previous)
        raise


@dataclasses.dataclass(frozen=True)
class _PatchToPutBack:
    """A model's patch as it is, for :func:`_put_back`: its spec, its rotary module's train/eval
    mode (a new rotary module would take the mode of the original one, which is kept outside the
    module tree, where ``model.train()`` does not reach it), and its config object with the values
    it holds now (the patch's, and the caller's changes since patching, such as use_cache)."""

    spec: PatchSpec
    training: bool
    config: Any
    config_values: dict[str, Any]


def _patch_to_put_back(model: nn.Module) -> _PatchToPutBack | None:
    """The model's patch (None: none), for a caller that patches it otherwise and then puts it back."""
    previous = get_patch_info(model)
    if previous is None:
        return None
    if previous.method not in list_methods():
        # Its frequencies could not be rebuilt once another patch replaced it.
        raise ValueError(
            f"This model is patched with method {previous.method!r}, which has been unregistered; register it again "
            "(hf_rope_ext.register_method) or call unpatch_model(model) first."
        )
    _, rotary = _patched_modules(model)[0]
    if rotary.method != get_method(previous.method):
        # registered again since (unregister_method, register_method): the patch could not be rebuilt
        raise ValueError(
            f"This model is patched with method {previous.method!r}, which has been registered again since, with "
            "other code; call unpatch_model(model) first, then patch_model(model, ...) with the method as it is now."
        )
    return _PatchToPutBack(previous, rotary.training, rotary.config, dict(vars(rotary.config)))


def _put_back(model: nn.Module, previous: _PatchToPutBack | None, function: str = "patch_model") -> None:
    """Leave ``model`` with the patch ``previous`` (from :func:`_patch_to_put_back`; None: none)
    after other patches were tried on it. Not refused in training mode: the model had it."""
    if _patched_modules(model):
        _unpatch(model, function)
    if previous is not None:
        _install(model, _rotary_target(model), previous.spec, restoring=previous)


_AUTO_OPTIONS = {"calibration_ids": "calibration_ids", "candidates": "candidates", "objective": "objective",
                 "calibration_length": "length", "cache": "cache", "cache_path": "cache_path",
                 "progress": "progress"}  # fmt: skip


def _takes_auto_option(option: str, value: Any) -> bool:
    """Whether ``value`` has a type the auto option ``option`` takes (token ids: anything but text or a number)."""
    if option in ("cache", "progress"):
        return isinstance(value, bool)
    if option == "calibration_length":
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if option == "candidates":
        return isinstance(value, (str, list, tuple))
    if option == "objective":
        return isinstance(value, str)
    if option == "cache_path":
        return isinstance(value, (str, os.PathLike))
    return not isinstance(value, (str, bytes, numbers.Number))


def _unknown_auto_options_advice(unknown: dict[str, Any]) -> str:
    """A hint for each misspelt option (a close spelling that takes its value's type: following
    it must not lead to another error) and, for a method's parameter, how to set it."""

    advice = []
    for name, value in unknown.items():
        options = [option for option in _AUTO_OPTIONS if _takes_auto_option(option, value)]
        close = difflib.get_close_matches(name, options, n=1, cutoff=0.8)
        if close:
            advice.append(f"Did you mean {close[0]} (not {name})?")
    method_params = {key for method in list_methods() for key in get_method(method).defaults}
    if any(name in method_params for name in unknown):
        advice.append("Name a method to set its parameters.")
    return " ".join(advice)


def _patch_auto(model, scale, max_length, original_max_length, steps_per_doubling, logn_attention, options):
    from .auto import choose_configuration

    unknown = sorted(set(options) - set(_AUTO_OPTIONS))
    if unknown:
        advice = _unknown_auto_options_advice({name: options[name] for name in unknown})
        raise ValueError(
            f"method='auto' chooses the method's parameters itself; it takes {', '.join(_AUTO_OPTIONS)}, "
            f"not {', '.join(unknown)}." + (f" {advice}" if advice else "")
        )
    if steps_per_doubling is not NOT_GIVEN or logn_attention not in (None, False):
        raise ValueError(
            "method='auto' chooses among whole configurations; steps_per_doubling and logn_attention are not taken "
            "(list 'self-extend+logn' among candidates= to try log-n attention)."
        )
    choice = choose_configuration(
        model, options.get("calibration_ids"), scale, max_length=max_length, original_max_length=original_max_length,
        **{_AUTO_OPTIONS[name]: value for name, value in options.items() if name != "calibration_ids"},
    )  # fmt: skip
    logger.info("method='auto' chose %s.", choice.chosen)
    return patch_model(model, choice.scale, choice.method, original_max_length=choice.original_length, **choice.params)


def apply_spec(model: nn.Module, spec: PatchSpec) -> nn.Module:
    """Patch ``model`` as ``spec`` says (:meth:`hf_rope_ext.spec.PatchSpec.apply`); returns the model.

    The spec's ``rotary_dim`` and ``original_rope_theta``, when set, must be the model's.
    """
    if not isinstance(spec, PatchSpec):
        raise TypeError(f"apply_spec expects a PatchSpec, got {type(spec).__name__}.")
    _check_is_model(model, "apply_spec")
    _check_no_prefix_tuning(model, "apply_spec")
    with _keeping_the_patch_on_error(model):
        _install(model, _rotary_target(model, "apply_spec"), spec)
    return model


class _Target:
    """The rotary module of a model about to be patched, and its RoPE facts."""

    def __init__(self, module_name: str, module: nn.Module, config: Any, model_type: str, rope: dict[str, Any]):
        self.module_name, self.module, self.config, self.model_type = module_name, module, config, model_type
        self.base = float(rope["rope_theta"])
        self.rotary_dim = 2 * module.inv_freq.shape[-1]
        # The fraction this module rotates (mixtral, olmo, ... ignore the config's partial_rotary_factor).
        self.kept = config_io.kept_rope_fields(config, rope, self.rotary_dim)
        self.rope = rope


def _rotary_target(model: nn.Module, function: str = "patch_model") -> _Target:
    """Unpatch ``model`` if needed, then find and check its rotary module."""
    if _patched_modules(model):
        # A patched rotary module that peft's modules_to_save copied (patched before wrapping) could
        # not be found again once unpatched (find_rotary_module refuses it): refuse before
        # unpatching, so the model keeps its patch.
        copied = [name for name, module in model.named_modules()
                  if isinstance(module, ExtendedRotaryEmbedding) and "modules_to_save" in name]
        if copied:
            raise ValueError(
                f"{function}: peft's modules_to_save holds this model's patched rotary module ({copied[0]}), so its "
                "patch cannot be changed (it is kept); to use other settings, patch the model with them before "
                "wrapping it with peft, or leave the rotary module out of modules_to_save."
            )
        _unpatch(model, function)
    model_config = getattr(model, "config", None)
    if model_config is not None and getattr(model_config, "rope_parameters", None):
        compat.rope_parameters(model_config)  # clear error for per-layer-type RoPE before searching modules
    module_name, original = find_rotary_module(model)
    model_type = _model_type(model)
    config = getattr(original, "config", None) or getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no config; patch a transformers model.")
    record = config_io.read_record(config)  # a present null or list is refused as an edited record
    if record is not None:
        # Loaded from a patched checkpoint with plain from_pretrained: its config holds the patched
        # RoPE (ntk writes a plain rope_type with a larger rope_theta), not the trained one.
        raise ValueError(
            f"This model was loaded from a checkpoint saved with an hf_rope_ext patch ({describe_record(record)}); its "
            "config holds the patched RoPE, not the original. Load it with hf_rope_ext.hub.load_patched (or call "
            "hf_rope_ext.hub.restore_patch(model)); patch_model then re-patches from the original."
        )
    rope = compat.rope_parameters(config)
    scaled = compat.already_scaled_message(model_type, rope, getattr(config, "max_position_embeddings", "?"))
    if scaled is not None:
        raise ValueError(scaled)
    target = _Target(module_name, original, config, model_type, rope)
    if original.inv_freq.is_meta:
        raise ValueError(
            f"model_type {model_type!r}: the model is on the meta device (no weights yet); load its weights "
            "(from_pretrained, or to_empty and load_state_dict), then patch it."
        )
    _verify_layout(original, target.rotary_dim, target.base, model_type)
    return target


def describe_record(record: Any) -> str:
    """``ntk x4 from 32 tokens``: a patch record in a few words (whatever its state)."""
    if not isinstance(record, dict):
        return f"record {record!r}"
    original = record.get("original_max_position_embeddings", "?")
    return f"{record.get('method', '?')} x{record.get('scale', '?')} from {original} tokens"


def _install(model: nn.Module, target: _Target, spec: PatchSpec, restoring: _PatchToPutBack | None = None) -> None:
    """Apply ``spec`` to ``target`` in ``model``. ``restoring``: putting back the patch the model
    had (``spec`` is its spec), which the training-mode check must not refuse; the rotary module
    and the config object get the mode and the values they had."""
    spec = spec.bound_to(target.rotary_dim, target.base, target.kept, target.module_name)
    original, base, rotary_dim = target.module, target.base, target.rotary_dim
    rope_method = spec.rope_method
    resolved = spec.resolved_params()
    original_length = spec.original_max_position_embeddings
    remap = _position_remap(spec, rope_method.attention, resolved)
    below = rope_method.attention_below_settle
    remap_below_settle = _position_remap(spec, below, resolved) if rope_method.settle_length is not None else None
    attention_level = remap is not None or spec.logn_attention
    copies = _config_copies(model, target.config)
    if attention_level:
        from .attention import check_attention_modules

        check_attention_modules(model, target.config, spec.label, target.model_type)
    dropout = _attention_dropout(model, target.config) if attention_level else 0.0
    if dropout and model.training and not restoring:  # (a training forward refuses it anyway)
        raise ValueError(attention_dropout_message(spec.label, dropout))

    extended = spec.extended_context
    try:
        rotary = ExtendedRotaryEmbedding(original, rope_method, resolved, rotary_dim, base, spec.steps_per_doubling)
    except ArithmeticError as error:  # a settle length of finite but absurd parameters (frequencies_scale=1e308)
        raise ValueError(f"method {spec.method!r} cannot use {resolved} ({error}); check its parameters.") from None
    inv_freq, attention = rotary.frequencies(extended)
    unchanged = torch.allclose(inv_freq, default_inv_freq(rotary_dim, base), rtol=1e-9, atol=0) and attention == 1.0
    if unchanged and remap is None and not spec.logn_attention:
        raise ValueError(
            f"method {spec.method!r} with {spec.params or 'default parameters'} leaves the frequencies unchanged at "
            f"{extended} tokens: the patch would do nothing. Check the method's parameters."
        )

    # The patch is written to a copy of the config, which the model gets once everything else
    # worked: the config object may be shared with another model (two models built from one
    # config), which must not change.
    config = copy.deepcopy(target.config)
    if hasattr(config, "head_dim") and config.head_dim is None:  # transformers' yarn/longrope read it
        config.head_dim = config_io.head_dim_of(config)
    new_rope, max_positions = config_io.rope_config_for(rope_method, resolved, base, rotary_dim, spec.kept)
    # Phi-3 configs also hold the trained context at the top level, and transformers takes it over
    # rope_parameters' (its class default, 4096, often differs): it must say L0 as well.
    if hasattr(config, "original_max_position_embeddings"):
        config.original_max_position_embeddings = original_length
    compat.write_rope_config(config, new_rope, max_positions)
    setattr(config, config_io.RECORD_ATTRIBUTE, spec.to_record())
    rotary.config, rotary.original_config, rotary.spec = config, target.config, spec
    rotary.attention_dropout = dropout
    # a new module is in training mode; the model may not be
    rotary.train(original.training if restoring is None else restoring.training)

    caller, attribute = owner_and_attribute(model, target.module_name)
    try:
        if rope_method.length_dependent:
            rotary.cache_guard = PrefixRecompute(caller, rotary, model)
        elif not attention_level:  # attention-level patches keep this record in their own hooks
            rotary.cache_guard = CacheRecord(caller, rope_method.name)
        if attention_level:
            from . import attention as attention_level_module

            settled = rotary.settle_length
            # A remap that starts at a settle length rotates with the settled frequencies.
            remap_freq = inv_freq if settled is None else rotary.frequencies(settled + 1)[0]
            rotary.attention_patch = attention_level_module.install(
                config, remap, remap_freq, original_length, spec.logn_attention,
                # Always the rotary's own test (true at every length without a settle length): the
                # attention patch then refers to the rotary module, so pickling a patched model
                # reaches the rotary module's refusal (ExtendedRotaryEmbedding.__reduce_ex__).
                remap_applies=rotary.remap_applies,
                remap_below_settle=remap_below_settle,
                inv_freq_below_settle=None if remap_below_settle is None else rotary.frequencies(settled)[0],
                model=caller,
                method=rope_method.name,
                forward_state=rotary,
            )
    except Exception:
        if rotary.cache_guard is not None:
            rotary.cache_guard.remove()
        raise
    if restoring is not None:
        config = _config_put_back(restoring, rotary)
    setattr(caller, attribute, rotary)
    _swap_config(model, target.config, config)
    # Copies of the config (a layer peft copied) get the patch's config too, and their own back on unpatching.
    for module, name, _ in copies:
        vars(module)[name] = config
    rotary.config_copies = copies
    logger.info(
        "Patched %s (%s) with %s, scale %g: context %d -> %d tokens.",
        target.module_name,
        target.model_type,
        rope_method.name,
        spec.scale,
        original_length,
        extended,
    )


def _config_put_back(previous: _PatchToPutBack, rotary: ExtendedRotaryEmbedding) -> Any:
    """The config object the model had with ``previous``, holding the values it had then, made the
    config of the patch put back (``rotary``, built from the same spec): a caller's reference to it
    stays the model's config, with their changes since patching. Only its attention registry name
    is the new patch's (the old name was unregistered with the old patch)."""
    config = previous.config
    vars(config).clear()  # unpatching made it read as the original config
    vars(config).update(previous.config_values)
    if rotary.attention_patch is not None:
        config._attn_implementation = rotary.attention_patch.name
        rotary.attention_patch.config = config
    rotary.config = config
    return config


def _position_remap(spec: PatchSpec, make_remap: Any, resolved: dict[str, Any]) -> Any:
    """The method's position remap (None without one), checked: a registered ``attention=``
    function that returns anything else would fail only at the first long forward."""
    if make_remap is None:
        return None
    from .attention import PositionRemap

    remap = make_remap(resolved)
    if not isinstance(remap, PositionRemap):
        raise ValueError(
            f"method {spec.method!r}: attention must return a hf_rope_ext.attention.PositionRemap, "
            f"got {type(remap).__name__}."
        )
    return remap


def _attention_dropout(model: nn.Module, config: Any) -> float:
    """The largest attention dropout of the model: its config's, or an attention module's own copy."""
    values = [getattr(config, "attention_dropout", 0.0)]
    values += [getattr(module, "attention_dropout", 0.0) for module in model.modules()]
    return max((float(value) for value in values if is_real(value)), default=0.0)


def _config_copies(model: nn.Module, config: Any) -> list[tuple[nn.Module, str, Any]]:
    """``(module, attribute, value)`` for each config object of the model's config class, other than
    ``config``, that a module of ``model`` holds: peft's ``modules_to_save`` deep-copies a decoder
    layer, whose attention then holds its own config object, and ``merge_and_unload`` keeps that
    copy. Such a copy belongs to the model (it is in its module tree) whatever its values: the user
    may have edited ``model.config`` since (pad_token_id, resize_token_embeddings), so values are
    not compared; each copy is pointed at the patched config and gets its own object back on unpatching."""
    return [
        (module, name, value)
        for module in model.modules()
        if not isinstance(module, ExtendedRotaryEmbedding)
        for name, value in list(vars(module).items())
        if value is not config and type(value) is type(config)
    ]


def _restore_config_copies(model: nn.Module, rotary: ExtendedRotaryEmbedding) -> None:
    """Give each module that held a copy of the model's config its own object back (see
    :func:`_config_copies`), and make every copy of the patch's config in ``model`` (a layer
    peft deep-copied after patching) read as the original config."""
    for module, name, value in getattr(rotary, "config_copies", ()):
        if vars(module).get(name) is rotary.config:
            vars(module)[name] = value
    rotary.config_copies = []
    record = getattr(rotary.config, config_io.RECORD_ATTRIBUTE, None)
    if record is None:
        return
    for module in model.modules():
        if isinstance(module, ExtendedRotaryEmbedding):
            continue
        for value in list(vars(module).values()):
            if (
                value is not rotary.config
                and type(value) is type(rotary.config)
                and getattr(value, config_io.RECORD_ATTRIBUTE, None) == record
            ):
                vars(value).clear()
                vars(value).update(copy.deepcopy(vars(rotary.original_config)))


def _swap_config(model: nn.Module, old: Any, new: Any) -> None:
    """Point every module of ``model`` that holds the config ``old`` (``model.config``, each
    layer's ``.config``) at ``new``. The patched rotary module keeps both on purpose."""
    for module in model.modules():
        if isinstance(module, ExtendedRotaryEmbedding):
            continue
        attributes = vars(module)
        for name, value in list(attributes.items()):
            if value is old:
                attributes[name] = new


_CALL_ELSEWHERE = (
    "{function}: a forward or generate call of this patched model is under way on another thread, and {consequence}; "
    "call {function} once it has ended (join that thread), or give each thread its own copy (copy.deepcopy(model))."
)
_CALL_HERE = (
    "{function} was called inside a forward or generate call of this model (from a hook, a logits processor or a "
    "planned_length block), and {consequence}; call it after that call returns."
)
_HALF_PATCHED = "that call would finish half patched (wrong logits)"


def _forward_threads(rotary: ExtendedRotaryEmbedding) -> list[ForwardThreads]:
    """The counts of the calls under way that a patch keeps (length-dependent and attention-level
    patches; a static rotary-only patch keeps none: its forwards may run on several threads, and
    each computes its cos/sin once, before any swap could reach it)."""
    counts = (getattr(guard, "forward_threads", None) for guard in (rotary.cache_guard, rotary.attention_patch))
    return [each for each in counts if isinstance(each, ForwardThreads)]


def _check_no_call_under_way(patched: list[tuple[str, ExtendedRotaryEmbedding]], function: str,
                             consequence: str = _HALF_PATCHED) -> None:
    """Refuse ``function`` while this thread runs a forward or generate of the model (from a
    hook). Another thread's call is refused, atomically, by :func:`_holding_the_patch`."""
    for _, rotary in patched:
        if any(threads.under_way_here() for threads in _forward_threads(rotary)):
            raise RuntimeError(_CALL_HERE.format(function=function, consequence=consequence))


@contextlib.contextmanager
def _holding_the_patch(patched: list[tuple[str, ExtendedRotaryEmbedding]], function: str,
                       consequence: str = _HALF_PATCHED) -> Iterator[None]:
    """Hold the patch for this thread during the block: refused if a forward or generate of the
    model is under way on any thread, and another thread's forward is refused meanwhile."""
    _check_no_call_under_way(patched, function, consequence)
    with contextlib.ExitStack() as stack:
        for _, rotary in patched:
            for threads in _forward_threads(rotary):
                stack.enter_context(threads.held(_CALL_ELSEWHERE.format(function=function, consequence=consequence)))
        yield


@contextlib.contextmanager
def no_call_under_way(model: nn.Module, function: str, consequence: str) -> Iterator[None]:
    """Run the block (``function``, e.g. a save) with no forward or generate of ``model`` under
    way on any thread: refused in one line (``RuntimeError``, saying ``consequence``) while one
    is, and another thread's call is refused until the block ends. A model without a patch, or
    with a static rotary-only one, has no calls to wait for."""
    with _holding_the_patch(_patched_modules(model, function), function, consequence):
        yield


def unpatch_model(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_model`: the original rotary module, config object and no hooks. Returns the model.

    Refused (``RuntimeError``) while a forward of the model, or a ``generate`` or
    :func:`hf_rope_ext.planned_length` block of a length-dependent patch (the default's too), is
    under way on another thread, or on this one from inside it (a hook, a logits processor): that
    call would finish half patched. (Static rotary-only patches, such as yarn, count no calls: a
    forward keeps the cos/sin it computed first.)
    """
    return _unpatch(model, "unpatch_model")


def _unpatch(model: nn.Module, function: str) -> nn.Module:
    patched = _patched_modules(model, function)
    if not patched:
        raise ValueError(f"{type(model).__name__} is not patched by hf_rope_ext; nothing to undo.")
    with _holding_the_patch(patched, function):
        _remove_patches(model, patched)
    return model


def _remove_patches(model: nn.Module, patched: list[tuple[str, ExtendedRotaryEmbedding]]) -> None:
    for module_name, rotary in patched:
        # The module and the config first: nothing below can fail and leave the model half patched.
        caller, attribute = owner_and_attribute(model, module_name)
        setattr(caller, attribute, rotary.original_rotary)
        _restore_config_copies(model, rotary)
        _swap_config(model, rotary.config, rotary.original_config)
        if rotary.cache_guard is not None:
            rotary.cache_guard.remove()
        if rotary.attention_patch is not None:
            from . import attention as attention_level

            attention_level.uninstall(rotary.attention_patch)
        # A module outside `model` may still hold the patch's copy (the outer model, when patched
        # through it and unpatched through its base model): make it read as the original.
        unpatched = copy.deepcopy(vars(rotary.original_config))
        vars(rotary.config).clear()
        vars(rotary.config).update(unpatched)
        logger.info("Restored the original rotary embedding at %s.", module_name)


def get_patch_info(model: nn.Module) -> PatchSpec | None:
    """How ``model`` is patched (a :class:`hf_rope_ext.spec.PatchSpec`, with ``module_name`` set),
    or None if it is not."""
    patched_modules = _patched_modules(model, "get_patch_info")
    if not patched_modules:
        return None
    module_name, rotary = patched_modules[0]
    return rotary.spec.at_module(module_name)  # relative to the model asked about


@contextlib.contextmanager
def patched(model: nn.Module, scale: float | None = None, method: str = DEFAULT_METHOD, **kwargs: Any) -> Iterator[nn.Module]:
    """Context manager form of :func:`patch_model`: on exit the model is as it was before,
    including a patch it already had (its config object, with its values, and its rotary
    module's mode)."""
    previous = _patch_to_put_back(model)
    patch_model(model, scale, method, **kwargs)
    try:
        yield model
    finally:
        # a block that unpatched the model gets no error here, which would hide its own
        _put_back(model, previous, "unpatch_model")
