"""Everything that depends on the transformers version, in one place.

Tested with transformers 5.x, where all RoPE settings live in ``config.rope_parameters`` and the
KV cache is a ``transformers.cache_utils.Cache``.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
import math
import numbers
from typing import Any

import torch
import transformers
from packaging import version

logger = logging.getLogger(__name__)

MIN_TRANSFORMERS = version.parse("5.0.0")

try:
    from transformers.cache_utils import Cache
except ImportError as error:  # pragma: no cover - only on unsupported versions
    raise ImportError(
        f"hf_rope_ext needs transformers >= {MIN_TRANSFORMERS} (found {transformers.__version__}): "
        "pip install -U 'transformers>=5,<6'"
    ) from error

from transformers import GenerationConfig  # noqa: E402
from transformers.modeling_rope_utils import (  # noqa: E402
    ROPE_INIT_FUNCTIONS,  # noqa: F401  (the registry transformers reads; config_io adds our types to it)
    RotaryEmbeddingConfigMixin,
)


def rope_parameters(config: Any) -> dict[str, Any]:
    """The config's flat RoPE parameter dict (the live object, not a copy).

    Raises ``ValueError`` for configs with per-layer-type RoPE (nested dicts), which this
    package does not support.
    """
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or not params:
        raise ValueError(
            f"model_type {getattr(config, 'model_type', '?')!r}: config has no `rope_parameters`; "
            "is this a RoPE model?"
        )
    nested = config.nested_rope_parameter_keys(params) if hasattr(config, "nested_rope_parameter_keys") else []
    if nested:
        raise ValueError(
            f"model_type {config.model_type!r} uses different RoPE settings per layer type ({nested}); "
            "hf_rope_ext supports one RoPE for all layers (Llama, Mistral, Qwen2, Qwen3 and alike)."
        )
    return params


def already_scaled_message(model_type: Any, rope: dict[str, Any], max_positions: Any) -> str | None:
    """The refusal of a config whose RoPE is already scaled (None: plain RoPE). Such checkpoints
    (Llama 3.1's llama3, Qwen2.5's yarn) were trained with their scaling: it cannot be taken off."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    factor = f", factor {rope['factor']}" if rope.get("factor") is not None else ""
    return (
        f"model_type {model_type!r} already uses RoPE scaling (rope_type={rope_type!r}{factor} in its config); "
        "hf_rope_ext extends models trained with plain RoPE, and a checkpoint trained with its scaling needs it: use "
        f"this model as it is (its config gives {max_positions} positions), or patch a plain-RoPE model."
    )


def snapshot_config(config: Any, extra_attributes: tuple[str, ...]) -> dict[str, Any]:
    """Deep copies of the config fields a patch changes, to restore them exactly."""
    saved = {"rope_parameters": copy.deepcopy(config.rope_parameters)}
    saved["max_position_embeddings"] = config.max_position_embeddings
    for name in extra_attributes:
        saved[name] = copy.deepcopy(getattr(config, name)) if hasattr(config, name) else _MISSING
    return saved


def restore_config(config: Any, saved: dict[str, Any]) -> None:
    """Undo :func:`write_rope_config`, in place (the rotary module shares this config object)."""
    live = config.rope_parameters
    live.clear()
    live.update(copy.deepcopy(saved["rope_parameters"]))
    try:
        config.max_position_embeddings = saved["max_position_embeddings"]
    except Exception:  # strict validation may refuse a value the config held before (None)
        object.__setattr__(config, "max_position_embeddings", saved["max_position_embeddings"])
    for name, value in saved.items():
        if name in ("rope_parameters", "max_position_embeddings"):
            continue
        if value is _MISSING:
            if name in config.__dict__:
                delattr(config, name)
        else:
            setattr(config, name, copy.deepcopy(value))


def write_rope_config(config: Any, new_parameters: dict[str, Any], max_position_embeddings: int) -> None:
    """Replace the RoPE parameters in place and check them the way transformers does.

    The dict is mutated, never reassigned: assigning a fresh dict to ``config.rope_parameters``
    loses keys that transformers filled in at load time (``rope_theta``). If the config class
    rejects the new parameters, the config is left as it was and the error names the model type.
    """
    saved = snapshot_config(config, ())
    live = config.rope_parameters
    live.clear()
    live.update(new_parameters)
    try:
        config.max_position_embeddings = int(max_position_embeddings)
        if not new_parameters["rope_type"].startswith("hf_rope_ext."):
            config.standardize_rope_params()
            config.validate_rope()
        elif type(config).validate_rope is not RotaryEmbeddingConfigMixin.validate_rope:
            # Some config classes restrict the rope types they accept (Phi-3: longrope only);
            # the generic validator only warns that it has no checks for our types.
            config.validate_rope()
    except Exception as error:
        restore_config(config, saved)
        raise ValueError(
            f"model_type {getattr(config, 'model_type', '?')!r}: its config rejects rope_type "
            f"{new_parameters['rope_type']!r}: {error}"
        ) from error


_MISSING = object()


def is_cache(obj: Any) -> bool:
    return isinstance(obj, Cache)


# The keyword a model's forward takes its KV cache under: `past_key_values` up to transformers
# 5.23, `cache` from 5.24 on (where `past_key_values` is still accepted, with a deprecation
# warning, and renamed by a decorator *inside* the forward, so forward hooks see either name).
CACHE_ARGUMENT_NAMES = ("cache", "past_key_values")


def cache_argument_name(parameters: Any) -> str | None:
    """The name under which a forward with these parameter names takes the KV cache (None: none)."""
    return next((name for name in CACHE_ARGUMENT_NAMES if name in parameters), None)


def call_arguments(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict[str, Any]:
    """A forward call's arguments by name (what ``**kwargs`` caught merged in), for hooks that read
    the cache or the position ids however the caller passed them. ``TypeError`` if they do not bind."""
    arguments = {}
    for name, value in signature.bind_partial(*args, **kwargs).arguments.items():
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(value)
        else:
            arguments[name] = value
    return arguments


def cache_argument(arguments: dict[str, Any]) -> tuple[str | None, Any]:
    """``(name, cache)`` of the cache a call was given under either name (``(None, None)``: none)."""
    for name in CACHE_ARGUMENT_NAMES:
        if arguments.get(name) is not None:
            return name, arguments[name]
    return None, None


def output_cache(output: Any) -> Any:
    """The KV cache a model output carries (``cache`` from transformers 5.24, ``past_key_values`` before)."""
    # Only the field the output class declares: from 5.24 reading `.past_key_values` of an
    # output without a cache (use_cache=False) falls through to a property that logs a deprecation.
    declared = {item.name for item in dataclasses.fields(output)} if dataclasses.is_dataclass(output) else None
    for name in CACHE_ARGUMENT_NAMES:
        if declared is not None and name not in declared:
            continue
        value = output.get(name) if isinstance(output, dict) else getattr(output, name, None)
        if value is not None:
            return value
    return None


def planned_generation_length(model: Any, args: tuple, kwargs: dict) -> int:
    """The sequence length a ``model.generate(*args, **kwargs)`` call can reach.

    The arguments are read as the model's ``generate`` binds them (a ``generation_config`` passed
    second positionally included), and the length resolved as transformers resolves it
    (``_prepare_generation_config`` and ``_prepare_generated_length``): each of ``max_new_tokens``
    and ``max_length`` comes from the call, else a ``generation_config`` passed to it, else the
    model's own; ``max_new_tokens`` wins. Without either, transformers' default ``max_length`` (20)
    counts new tokens after the prompt, capped at the ``config.max_position_embeddings`` the call
    reads: the patch's extended context, which the planning ``generate`` puts there for the call
    (see ``cache_consistency``). Prompt-lookup decoding verifies candidates past that length, which
    the plan covers too (``_candidates_past_max_length``).

    An unbounded length (``max_new_tokens`` or ``max_length`` ``float("inf")``, which transformers
    runs until a stopping criterion, eos or ``max_time`` ends the call) is planned as
    ``max_length`` = that context: the longest the patch is made for, so the call recomputes nothing
    before it. A length that is no number of tokens (nan, "x") is refused (``_whole_tokens``).
    """
    arguments = _generate_arguments(model, args, kwargs)
    inputs = arguments.get("inputs")
    if inputs is None:  # as _prepare_model_inputs: the model's input name stands in for inputs=None
        inputs = arguments.get(getattr(model, "main_input_name", "input_ids"))
    embeds = arguments.get("inputs_embeds")
    ids_width = inputs.shape[1] if isinstance(inputs, torch.Tensor) and inputs.dim() >= 2 else 0
    embeds_width = embeds.shape[1] if isinstance(embeds, torch.Tensor) and embeds.dim() >= 2 else None
    configs = [arguments.get("generation_config"), getattr(model, "generation_config", None)]

    def setting(name: str) -> Any:
        if name in arguments:  # generate sets the config from its keywords, None included
            return arguments[name]
        return next((getattr(config, name) for config in configs if getattr(config, name, None) is not None), None)

    max_new_tokens = _whole_tokens(setting("max_new_tokens"), "max_new_tokens", unbounded=True)
    max_length = _whole_tokens(setting("max_length"), "max_length", unbounded=True)
    # The generated ids start at ids_width (0 for inputs_embeds alone); embeddings in their place
    # make the sequence the model sees that much longer.
    extra = 0 if embeds_width is None else embeds_width - ids_width
    if max_new_tokens == math.inf or (max_new_tokens is None and max_length == math.inf):
        context = _context_during_generate(model)  # as max_length = context (the prompt alone without one)
        final = ids_width if context is None else context - (embeds_width if extra else 0)
    elif max_new_tokens is not None:
        final = ids_width + max_new_tokens
    elif max_length is not None:
        final = max_length - (embeds_width if extra else 0)
    else:
        final = _DEFAULT_MAX_LENGTH + ids_width
        context = _context_during_generate(model)
        if context is not None:
            final = min(final, context)
    final += _candidates_past_max_length(setting)
    return max(final + extra, ids_width + extra)


def _generate_arguments(model: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """A ``generate`` call's arguments by name, bound to the model class's ``generate`` as it binds
    them. Arguments that do not bind are left for ``generate`` to refuse: the first positional one is
    then read as the inputs, the others not at all."""
    generate = getattr(type(model), "generate", None)
    try:
        signature = inspect.signature(generate.__get__(model))
        arguments = call_arguments(signature, args, kwargs)
    except (TypeError, ValueError, AttributeError):  # no generate, no signature, or arguments that do not bind
        return {**kwargs, "inputs": args[0]} if args else dict(kwargs)
    # A subclass's own generate may set a length, or a whole config, by default
    # (generate(self, ids, max_new_tokens=40), generation_config=GenerationConfig(...)).
    for name in _LENGTH_SETTINGS:
        parameter = signature.parameters.get(name)
        if name not in arguments and parameter is not None and parameter.default not in (None, parameter.empty):
            arguments[name] = parameter.default
    # ... and take its prompt under another name (generate(self, *args, **kwargs), generate(self, prompt)):
    # its first parameter, given by position or by name, read as the prompt where it holds token ids.
    prompt_names = ("inputs", getattr(model, "main_input_name", "input_ids"), "inputs_embeds")
    if not any(isinstance(arguments.get(name), torch.Tensor) for name in prompt_names):
        first = next(iter(signature.parameters.values()), None)
        if first is not None and first.kind is first.VAR_POSITIONAL:
            candidate = args[0] if args else None
        else:
            candidate = None if first is None else arguments.get(first.name)
        if _token_ids(candidate):
            arguments["inputs"] = candidate
    return arguments


def _token_ids(value: Any) -> bool:
    """Whether ``value`` looks like a batch of token ids (an integer tensor of shape (batch, length))."""
    return isinstance(value, torch.Tensor) and value.dim() == 2 and not value.is_floating_point() and not value.is_complex()


# The call's settings that decide its final length (see planned_generation_length).
_LENGTH_SETTINGS = ("max_new_tokens", "max_length", "prompt_lookup_num_tokens", "generation_config")


def _candidates_past_max_length(setting: Any) -> int:
    """How far past ``max_length`` a call's verification forwards can reach.

    ``PromptLookupCandidateGenerator`` (transformers/generation/candidate_generator.py) proposes up
    to ``prompt_lookup_num_tokens`` candidates from any length up to ``max_length - 2`` (its cap on
    ``max_length`` bounds where it copies from, not where the copies land), and the main model scores
    them all in one forward: up to ``max_length - 2 + prompt_lookup_num_tokens`` tokens. Assistant
    models' candidates stop at ``max_length - 1`` (``_calculate_new_tokens``); early exit's drafter
    runs the same model's ``generate`` with the call's prompt lookup, whose drafts then reach as far.
    """
    lookup = _whole_tokens(setting("prompt_lookup_num_tokens"), "prompt_lookup_num_tokens")
    return 0 if lookup is None else max(lookup - 2, 0)


def _whole_tokens(value: Any, name: str, *, unbounded: bool = False) -> int | float | None:
    """A length setting of a ``generate`` call as an int (5.7 -> 5; None stays None); with
    ``unbounded``, a value that reads as ``float("inf")`` (no limit, to transformers; also a 0-d
    tensor or numpy float) is ``math.inf``. Anything else that is no number of tokens (nan, -inf,
    "x") is refused here, where ``int()`` would fail without naming the setting, before the call's
    first forward: ValueError for a number, TypeError for anything else."""
    if value is None:
        return None
    try:
        # Python and numpy numbers, 0-d tensors and arrays, Decimal; not text ("5", "inf"), which
        # transformers compares with ints, nor a tensor of shape (1,), which it cannot fill with
        number = None if isinstance(value, (str, bytes)) or getattr(value, "ndim", 0) else float(value)
    except (TypeError, ValueError, RuntimeError):
        number = None
    if unbounded and number == math.inf:
        return math.inf
    try:
        if number is None or not math.isfinite(number):
            raise ValueError
        return int(value)
    except (TypeError, ValueError, OverflowError, RuntimeError):
        also = f", or {name}=float('inf') to let a stopping criterion end the call" if unbounded else ""
        error = ValueError if number is not None or isinstance(value, numbers.Number) else TypeError
        raise error(f"generate's {name} must be a whole number of tokens, got {value!r}; pass an int{also}.") from None


def _default_max_length() -> int:
    """transformers' default ``max_length`` (20): a class default from 5.x's ``_get_default_generation_params``,
    an ``__init__`` default before it."""
    defaults = getattr(GenerationConfig, "_get_default_generation_params", None)
    return int(defaults()["max_length"] if defaults is not None else GenerationConfig().max_length)


_DEFAULT_MAX_LENGTH = _default_max_length()


def _context_during_generate(model: Any) -> int | None:
    """``config.max_position_embeddings`` as a planning ``generate`` call reads it: raised to the
    patch's extended context for length-dependent patches, whose config keeps the original."""
    from .patching import get_patch_info  # patching imports this module

    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if not isinstance(context, int):
        return None
    spec = get_patch_info(model)
    return context if spec is None else max(context, spec.extended_context)
