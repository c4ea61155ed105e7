"""How a patch is written into a transformers config, and read back.

(Just over 400 lines: the convention, its writer for this package's own types and its checks in one place.)

The convention (the same in memory, in a saved ``config.json`` and on the Hub):

* ``rope_parameters`` describes the patched frequencies in transformers' own vocabulary
  whenever transformers has the method (``linear``, ``dynamic``, ``yarn``, ``llama3``,
  ``longrope``; ``ntk`` is plain RoPE with a raised ``rope_theta``), so plain transformers
  and vLLM rebuild the same frequencies without this package.
* ``rope_parameters["original_max_position_embeddings"]`` holds the context the model was
  trained on for every type that has the key (yarn, llama3, longrope and this package's own
  types). Both vLLM and llama.cpp's GGUF converter read the original context from there.
* ``max_position_embeddings`` is the extended context ``original * scale``, a whole number of
  tokens (:func:`hf_rope_ext.patching.patch_model` rounds the scale so; see
  :func:`extended_length`): llama.cpp's
  converter writes it as ``{arch}.context_length`` (the default ``--ctx-size``), and vLLM takes
  it as the maximum model length for ``default`` (ntk), ``llama3`` and ``longrope`` (vLLM's
  longrope also derives its attention factor from ``max_position_embeddings / original``).
  The one exception is a rope type whose name contains ``"dynamic"`` (``dynamic``,
  ``dynamic-yarn``, ``dynamic-linear``, user length-dependent methods): there
  ``max_position_embeddings`` stays at the original context, because transformers recomputes
  frequencies only for inputs longer than it (``dynamic_rope_update``), transformers' and
  vLLM's ``dynamic`` formulas divide by it, and vLLM multiplies it by ``factor`` for the
  maximum model length.
* Known disagreement: for ``linear`` vLLM derives the maximum length as
  ``max_position_embeddings * factor`` (original * scale**2 here), while llama.cpp takes
  ``max_position_embeddings`` itself; pass ``--max-model-len`` to vLLM
  (:func:`hf_rope_ext.runtimes.runtime_settings` prints it).
* ``config.hf_rope_ext`` records the patch (method, scale, parameters, original context and
  ``rope_theta``, ``steps_per_doubling``; :meth:`hf_rope_ext.spec.PatchSpec.to_record`) so a
  saved checkpoint can be re-patched exactly (:func:`verify_record` checks that it agrees with
  ``rope_parameters``) and described in a model card.

Each method writes its own ``rope_parameters`` (``RopeMethod.rope_parameters`` in
:mod:`hf_rope_ext.methods`); this module writes this package's own rope type for the others.

Sources read for the runtime side: vLLM ``vllm/config/model.py`` (``_get_and_verify_max_len``)
and ``vllm/model_executor/layers/rotary_embedding/__init__.py`` (``get_rope``); llama.cpp
``convert_hf_to_gguf.py`` (``TextModel.__init__`` reads ``rope_parameters`` or
``rope_scaling``, ``TextModel.set_gguf_parameters`` maps them to GGUF keys).

Methods transformers lacks are written as ``rope_type = "hf_rope_ext.<method>"`` and
registered in transformers' ``ROPE_INIT_FUNCTIONS`` when this package is imported. For the
built-in ones the string also says what to install, because it is all a user without the
package gets to see: transformers stops at load time with
``KeyError: 'hf_rope_ext.dynamic-yarn (needs `pip install hf-rope-ext` and `import hf_rope_ext`
before loading)'``, never with silently wrong frequencies. Checkpoints of user-registered
methods keep the bare ``hf_rope_ext.<method>`` (installing the package alone would not help:
the code that registers the method is needed).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import math
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from . import compat
from .methods import (
    COMMON_PARAMS,
    RopeMethod,
    checked_frequencies,
    get_method,
    is_builtin,
    list_methods,
    resolve_params,
    yarn_mscale,
)
from .families import rotates_partial
from .rotary import effective_length
from .spec import PatchSpec, RecordError, extended_length
from .validation import is_finite, is_real

logger = logging.getLogger(__name__)

RECORD_ATTRIBUTE = "hf_rope_ext"
CUSTOM_ROPE_TYPE_PREFIX = "hf_rope_ext."
# Appended to the rope_type of built-in methods: transformers' KeyError shows the string verbatim.
INSTALL_HINT = " (needs `pip install hf-rope-ext` and `import hf_rope_ext` before loading)"

# The one patch type; the name under which model cards and older code import it.
RecordedPatch = PatchSpec

__all__ = [
    "RECORD_ATTRIBUTE",
    "check_rope_spellings",
    "custom_rope_type",
    "extended_length",
    "head_dim_of",
    "kept_rope_fields",
    "legacy_attn_factor",
    "legacy_fields",
    "method_from_rope_type",
    "read_record",
    "register_with_transformers",
    "rope_config_for",
    "rotary_dim_of",
    "unregister_from_transformers",
    "verify_record",
]


def _bare_rope_type(method: RopeMethod) -> str:
    # transformers recomputes frequencies on every call only for rope types whose name
    # contains "dynamic", so length-dependent methods must carry that word.
    name = method.name
    if method.length_dependent and "dynamic" not in name:
        name = f"dynamic.{name}"
    return CUSTOM_ROPE_TYPE_PREFIX + name


def custom_rope_type(method: RopeMethod) -> str:
    """The ``rope_type`` string for a method transformers does not have."""
    bare = _bare_rope_type(method)
    return bare + INSTALL_HINT if is_builtin(method.name) else bare


def method_from_rope_type(rope_type: str) -> RopeMethod | None:
    """Inverse of :func:`custom_rope_type`; None for transformers' own types."""
    if not rope_type.startswith(CUSTOM_ROPE_TYPE_PREFIX):
        return None
    bare = rope_type[: -len(INSTALL_HINT)] if rope_type.endswith(INSTALL_HINT) else rope_type
    for name in list_methods():
        method = get_method(name)
        if method.transformers_rope_type is None and _bare_rope_type(method) == bare:
            return method
    raise ValueError(
        f"rope_type {rope_type!r} names an hf_rope_ext method that is not registered in this process; "
        "register it with hf_rope_ext.register_method before loading."
    )


def json_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, tuple):
        return list(value)
    return value


def rope_config_for(
    method: RopeMethod, params: Mapping[str, Any], base: float, rotary_dim: int, extra: Mapping[str, Any]
) -> tuple[dict[str, Any], int]:
    """``(rope_parameters, max_position_embeddings)`` describing a patch.

    ``params`` are the resolved parameters (with ``factor`` and
    ``original_max_position_embeddings``); ``extra`` holds keys of the model's original
    ``rope_parameters`` to keep (``partial_rotary_factor``). The method's own writer gives
    transformers' vocabulary; methods without one get this package's rope type.
    """
    original = int(params["original_max_position_embeddings"])
    if method.rope_parameters is not None:
        rope = method.rope_parameters(params, base, rotary_dim)
    else:
        own = {key: json_value(value) for key, value in params.items()
               if key not in COMMON_PARAMS and value is not None}  # fmt: skip
        rope = {
            "rope_type": custom_rope_type(method),
            "rope_theta": base,
            "factor": params["factor"],
            "original_max_position_embeddings": original,
            **own,
        }
    rope.update(extra)
    # See the module docstring: "dynamic" types start scaling beyond max_position_embeddings.
    max_positions = original if "dynamic" in rope["rope_type"] else extended_length(original, params["factor"])
    return rope, max_positions


def legacy_attn_factor(rope: Mapping[str, Any]) -> float | None:
    """YaRN's ``attention_factor`` in the spelling older vLLM releases read: their ``attn_factor``
    is multiplied by their own 0.1 ln(factor) + 1 (None: no attention_factor, or not yarn)."""
    if rope.get("rope_type") != "yarn" or rope.get("attention_factor") is None:
        return None
    return float(rope["attention_factor"]) / yarn_mscale(float(rope["factor"]))


def legacy_fields(rope: Mapping[str, Any]) -> dict[str, Any]:
    """``rope_scaling`` / ``rope_theta`` as transformers 4.x (and runtimes built on it) read them."""
    scaling = {key: value for key, value in rope.items() if key != "rope_theta"}
    if legacy_attn_factor(rope) is not None:
        # vLLM releases on transformers 4.x pass only attn_factor to their YaRN; transformers
        # itself uses attention_factor and ignores attn_factor (it logs it as unrecognized).
        scaling["attn_factor"] = legacy_attn_factor(rope)
    fields = {
        "rope_theta": rope["rope_theta"],
        "rope_scaling": None if scaling.get("rope_type") == "default" else scaling,
    }
    if scaling.get("rope_type") == "longrope":
        # transformers 4.x takes longrope's original context from this top-level key (the Phi-3
        # layout) and otherwise from max_position_embeddings; transformers 5 gives it priority.
        fields["original_max_position_embeddings"] = scaling["original_max_position_embeddings"]
    return fields


# ----------------------------------------------------------------------------------------------
# Reading a record back
# ----------------------------------------------------------------------------------------------


def head_dim_of(config: Any) -> int:
    """The per-head size (``head_dim``, or hidden_size / num_attention_heads where it is null)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rotary_dim_of(config: Any, rope: Mapping[str, Any] | None = None) -> int:
    """Number of dimensions per head the family's rotary module rotates (what patch_model reads
    from the module): Llama-style modules ignore ``partial_rotary_factor`` and rotate the whole head."""
    rope = rope if rope is not None else compat.rope_parameters(config)
    if not rotates_partial(getattr(config, "model_type", None)):
        return head_dim_of(config)
    factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    return int(head_dim_of(config) * factor)


def kept_rope_fields(
    config: Any, rope: Mapping[str, Any] | None = None, rotary_dim: int | None = None
) -> dict[str, Any]:
    """The base model's ``rope_parameters`` keys a patch keeps (``partial_rotary_factor``), as the
    module really rotates them: transformers' scaled rope types (linear, yarn, ...) and vLLM read
    the factor even for families whose own module ignores it, so a checkpoint must hold the true one.

    ``rotary_dim``: what the rotary module rotates (``2 * inv_freq.shape[-1]``), when the module is
    at hand; the config's factor is kept when it gives that dimension, else the module's fraction is
    written. Without it (a config alone) the family table says (:func:`rotary_dim_of`)."""
    rope = rope if rope is not None else compat.rope_parameters(config)
    if "partial_rotary_factor" not in rope:
        return {}
    factor = rope["partial_rotary_factor"]
    if rotary_dim is None:
        return {"partial_rotary_factor": factor if rotates_partial(getattr(config, "model_type", None)) else 1.0}
    head_dim = head_dim_of(config)
    if is_finite(factor) and int(head_dim * factor) == rotary_dim:
        return {"partial_rotary_factor": factor}
    return {"partial_rotary_factor": rotary_dim / head_dim}


def _record_error(config: Any, problem: str) -> ValueError:
    model_type = getattr(config, "model_type", "?")
    error = ValueError(
        f"model_type {model_type!r}: the `{RECORD_ATTRIBUTE}` entry of config.json {problem} "
        "The config was edited or is corrupt: restore the config.json that hf_rope_ext wrote, or delete the "
        f"`{RECORD_ATTRIBUTE}` entry to load the RoPE settings as plain transformers reads them."
    )
    error.problem = problem  # for callers that check a config in memory, not a file
    return error




def _differences(expected: Mapping[str, Any], actual: Mapping[str, Any]) -> list[str]:
    def same(a: Any, b: Any) -> bool:
        if isinstance(a, bool) or isinstance(b, bool):
            return a is b
        if is_finite(a) and is_finite(b):
            return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b

    problems = []
    for key in sorted(set(expected) | set(actual)):
        if key == "rope_type" and key in expected and key in actual:
            if _normalized_rope_type(expected[key]) != _normalized_rope_type(actual[key]):
                problems.append(f"rope_type is {actual[key]!r}, expected {expected[key]!r}")
        elif key not in actual:
            problems.append(f"{key!r} is missing (expected {expected[key]!r})")
        elif key not in expected:
            problems.append(f"{key!r}={actual[key]!r} is not part of this patch")
        elif not same(expected[key], actual[key]):
            problems.append(f"{key!r} is {actual[key]!r}, expected {expected[key]!r}")
    return problems


def _normalized_rope_type(rope_type: Any) -> Any:
    if isinstance(rope_type, str) and rope_type.endswith(INSTALL_HINT):
        return rope_type[: -len(INSTALL_HINT)]
    return rope_type


def verify_record(config: Any) -> PatchSpec | None:
    """Read ``config.hf_rope_ext`` and check it against ``rope_parameters``.

    Returns None when the config has no record (a checkpoint not written by this package).
    Raises ``ValueError`` naming the field when the record is malformed, names a method this
    process does not know, or contradicts ``rope_parameters`` / ``max_position_embeddings``
    (an edited or corrupt config.json): such a checkpoint would otherwise load with
    frequencies nobody intended.
    """
    if not hasattr(config, RECORD_ATTRIBUTE):
        return None
    record = getattr(config, RECORD_ATTRIBUTE)  # a present null is an edited record, refused as a list is
    rope = compat.rope_parameters(config)
    rotary_dim = rotary_dim_of(config, rope)
    kept = kept_rope_fields(config, rope)
    try:
        recorded = PatchSpec.from_record(record, rotary_dim=rotary_dim, kept=kept)
    except RecordError as error:
        raise _record_error(config, error.problem) from None
    method, scale, original = recorded.rope_method, recorded.scale, recorded.original_max_position_embeddings
    base = recorded.original_rope_theta
    expected_rope, expected_max_positions = rope_config_for(method, recorded.resolved_params(), base, rotary_dim, kept)
    # The legacy attn_factor (legacy_fields) is read back into rope_parameters by transformers 5.
    actual = dict(rope)
    if "attn_factor" in actual and "attn_factor" not in expected_rope:
        expected_rope["attn_factor"] = legacy_attn_factor(expected_rope)
    problems = _differences(expected_rope, actual)
    if config.max_position_embeddings != expected_max_positions:
        problems.append(
            f"max_position_embeddings is {config.max_position_embeddings!r}, expected {expected_max_positions}"
        )
    elif problems and _llama_style_factor_only(config, kept, expected_rope, actual):
        # Saved by hf_rope_ext before it wrote the factor the module rotates: the config is not
        # edited, and deleting the record leaves a factor transformers' scaled types apply to the head.
        raise ValueError(ignored_factor_message(config, actual["partial_rotary_factor"]))
    if problems:
        raise _record_error(
            config,
            f"(method {method.name!r}, scale {scale:g}, original context {original}) contradicts the RoPE fields: "
            + "; ".join(problems)
            + ".",
        )
    return recorded


def ignored_factor_message(config: Any, factor: Any) -> str:
    """The refusal of a checkpoint whose ``partial_rotary_factor`` its rotary module ignores."""
    return (
        f"model_type {getattr(config, 'model_type', '?')!r}: config.json holds partial_rotary_factor {factor!r}, which "
        "this family's rotary module ignores (it rotates the whole head); an earlier hf_rope_ext saved the base "
        "model's factor, so transformers rebuilds the wrong frequency count. Set partial_rotary_factor to 1.0 in "
        "rope_parameters and rope_scaling (and at the top level, if present) of config.json."
    )


def _llama_style_factor_only(config: Any, kept: Mapping[str, Any], expected: Mapping[str, Any],
                             actual: Mapping[str, Any]) -> bool:
    """Whether the RoPE fields differ from the record only by a ``partial_rotary_factor`` that a
    Llama-style family's module ignores: a checkpoint saved before hf_rope_ext wrote the factor the
    module rotates (and unloadable then too: transformers' scaled types apply it to the head)."""
    if rotates_partial(getattr(config, "model_type", None)) or kept.get("partial_rotary_factor") != 1.0:
        return False
    if actual.get("partial_rotary_factor") in (None, 1.0):
        return False
    return not _differences(expected, {**actual, "partial_rotary_factor": 1.0})


_TOP_LEVEL_ROPE = ("rope_theta", "original_max_position_embeddings")


def _numbers(value: Any, name: str = "") -> Iterator[tuple[str, float]]:
    """``(dotted name, number)`` for every float inside nested dicts and lists (JSON's NaN and
    Infinity included)."""
    if isinstance(value, float):
        yield name, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _numbers(item, f"{name}.{key}" if name else str(key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _numbers(item, f"{name}[{index}]")


# Fields of transformers' own rope types (and the top level) that hold numbers; transformers
# refuses another type deep in its validation, with a message that does not name the field.
_NUMERIC_ROPE_FIELDS = ("factor", "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim",
                        "low_freq_factor", "high_freq_factor", "original_max_position_embeddings", "rope_theta",
                        "partial_rotary_factor")  # fmt: skip


# transformers divides by these when it builds (and validates) the RoPE settings.
_HEAD_SIZE_FIELDS = ("num_attention_heads", "hidden_size", "head_dim")


def check_rope_types(raw: Mapping[str, Any], source: str) -> None:
    """Refuse a config.json that is not a JSON object, whose head sizes are not positive whole
    numbers, or whose RoPE numbers are not numbers (``"beta_fast": "32"``), naming the field."""
    if not isinstance(raw, Mapping):
        raise ValueError(
            f"{source}: config.json holds {json.dumps(raw)[:40]}, not a JSON object ({{...}}). Restore the file as "
            "it was written."
        )
    for name in _HEAD_SIZE_FIELDS:
        value = raw.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(
                f"{source}: config.json has {name} = {value!r}; it must be a positive whole number. Restore the file "
                "as it was written, or fix that field."
            )
    fields = {"max_position_embeddings": raw.get("max_position_embeddings")}
    fields.update({key: raw[key] for key in _TOP_LEVEL_ROPE if key in raw})
    for spelling in ("rope_parameters", "rope_scaling"):
        if isinstance(raw.get(spelling), Mapping):
            numeric = [key for key in _NUMERIC_ROPE_FIELDS if key in raw[spelling]]
            fields.update({f"{spelling}.{key}": raw[spelling][key] for key in numeric})
    for name, value in fields.items():
        if value is not None and not is_real(value):
            raise ValueError(
                f"{source}: config.json has {name} = {value!r}; it must be a number. Restore the file as it was "
                "written, or fix that field."
            )


def check_rope_spellings(raw: Mapping[str, Any], source: str) -> None:
    """Refuse a checkpoint's config.json whose two spellings of the RoPE settings disagree.

    ``raw`` is config.json as read from disk. :func:`hf_rope_ext.hub.save_patched` writes
    ``rope_parameters`` and, for transformers 4.x, the legacy ``rope_scaling`` and top-level
    ``rope_theta`` (and ``original_max_position_embeddings`` for longrope) beside it.
    transformers 5 reads ``rope_scaling`` first, so an edit of one spelling alone would be
    silently ignored (or take effect in one runtime only). Checked for configs this package
    wrote (those with a ``hf_rope_ext`` record).
    """
    params = raw.get("rope_parameters")
    if RECORD_ATTRIBUTE not in raw or not isinstance(params, Mapping) or "rope_scaling" not in raw:
        return
    legacy = raw["rope_scaling"]
    for name, value in _numbers(
        {"rope_parameters": params, "rope_scaling": legacy, **{key: raw[key] for key in _TOP_LEVEL_ROPE if key in raw}}
    ):
        if not math.isfinite(value):
            raise ValueError(
                f"{source}: config.json has {name} = {value!r}; it must be a finite number. Restore the file as it was "
                "written, or patch the model again."
            )
    expected = {key: value for key, value in params.items() if key != "rope_theta"}
    if isinstance(legacy, Mapping) and "attn_factor" in legacy and legacy_attn_factor(params) is not None:
        expected["attn_factor"] = legacy_attn_factor(params)  # written by legacy_fields
    problems = []
    if params.get("rope_type", "default") == "default":
        if legacy is not None:
            problems.append(f"rope_parameters is plain RoPE, rope_scaling is {legacy!r}")
    elif not isinstance(legacy, Mapping):
        problems.append(f"rope_scaling is {legacy!r}, rope_parameters has rope_type {params.get('rope_type')!r}")
    else:
        legacy = dict(legacy)
        if "type" in legacy and "rope_type" not in legacy:  # the oldest spelling
            legacy["rope_type"] = legacy.pop("type")
        for key in sorted(set(expected) | set(legacy)):
            if _differences({key: expected.get(key)}, {key: legacy.get(key)}):
                problems.append(
                    f"{key} is {expected.get(key, 'missing')!r} in rope_parameters, "
                    f"{legacy.get(key, 'missing')!r} in rope_scaling"
                )
    for key in _TOP_LEVEL_ROPE:
        if key in raw and key in params and _differences({key: params[key]}, {key: raw[key]}):
            problems.append(f"{key} is {params[key]!r} in rope_parameters, {raw[key]!r} at the top level")
    if problems:
        raise ValueError(
            f"{source}: config.json spells the RoPE settings twice and the two disagree ({'; '.join(problems)}). "
            "transformers 5 reads rope_scaling first and other runtimes read rope_parameters, so an edit of one "
            "alone takes effect in some runtimes only. Edit "
            "rope_parameters, rope_scaling and the top-level rope_theta the same way, or delete rope_scaling and "
            "the top-level rope_theta."
        )


def read_record(config: Any) -> dict[str, Any] | None:
    """The config's ``hf_rope_ext`` record as written, unchecked (:func:`verify_record` checks it)
    beyond being an object: None when the config has none; a present null or list is refused."""
    if not hasattr(config, RECORD_ATTRIBUTE):
        return None
    record = getattr(config, RECORD_ATTRIBUTE)
    if not isinstance(record, Mapping):
        raise _record_error(config, f"must be a JSON object, got {type(record).__name__}.")
    return dict(record)


# ----------------------------------------------------------------------------------------------
# transformers-side loading of this package's own rope types
# ----------------------------------------------------------------------------------------------


# Set while load_patched builds a model it patches again right after (no warning then).
_RESTORING: contextvars.ContextVar[bool] = contextvars.ContextVar("hf_rope_ext_restoring", default=False)


@contextlib.contextmanager
def restoring_patch() -> Iterator[None]:
    """Model construction inside is followed by the patch's own restore (``load_patched``)."""
    token = _RESTORING.set(True)
    try:
        yield
    finally:
        _RESTORING.reset(token)


# Configs already warned about (by id, with a weak reference to tell a new config at a reused id):
# transformers calls the rope-init function twice per model (construction, then _init_weights).
_WARNED_CONFIGS: dict[int, weakref.ref] = {}


def _first_warning_for(config: Any) -> bool:
    key = id(config)
    known = _WARNED_CONFIGS.get(key)
    if known is not None and known() is config:
        return False
    try:
        _WARNED_CONFIGS[key] = weakref.ref(
            config, lambda dead: _WARNED_CONFIGS.pop(key) if _WARNED_CONFIGS.get(key) is dead else None
        )
    except TypeError:  # not weak-referenceable: warn every time rather than never
        pass
    return True


def _transformers_init_function(rope_type: str):
    """A function with transformers' rope-init signature for one of our rope types."""

    def compute_rope_parameters(config, device=None, seq_len=None, layer_type=None):
        method = method_from_rope_type(rope_type)
        rope = compat.rope_parameters(config)
        missing = [key for key in ("rope_theta", *COMMON_PARAMS) if key not in rope]
        if missing:
            raise ValueError(
                f"config.rope_parameters with rope_type {rope_type!r} lacks {missing}; config.json is incomplete "
                "(hf_rope_ext writes rope_theta, factor and original_max_position_embeddings)."
            )
        rotary_dim = rotary_dim_of(config, rope)
        given = {key: rope[key] for key in method.defaults if key in rope}
        params = resolve_params(method, rotary_dim, given)
        params["factor"] = rope["factor"]
        params["original_max_position_embeddings"] = int(rope["original_max_position_embeddings"])
        record = read_record(config)
        if seq_len is None and record is not None:
            verify_record(config)  # model construction: refuse a contradictory config.json
        attention_level = method.attention is not None or (record or {}).get("logn_attention")
        if seq_len is None and not _RESTORING.get() and attention_level and _first_warning_for(config):
            # Not silent: a plain from_pretrained builds the frequencies only.
            # Without a record load_patched has nothing to rebuild the attention from either.
            fix = ("Load it with hf_rope_ext.hub.load_patched." if record is not None else
                   f"Its config.json has no `{RECORD_ATTRIBUTE}` record to rebuild the attention from (load_patched "
                   "neither): restore the config.json hf_rope_ext wrote, or patch the base model again.")  # fmt: skip
            logger.warning(
                "This checkpoint was saved with the attention-level patch %r; from_pretrained rebuilds its rotary "
                "frequencies only, not its attention, so inputs beyond %d tokens are not read as patched. %s",
                method.name + ("+logn" if (record or {}).get("logn_attention") else ""),
                params["original_max_position_embeddings"],
                fix,
            )
        steps = record.get("steps_per_doubling") if record else None
        # The patch's own rounding, so from_pretrained computes the frequencies patch_model uses.
        length = effective_length(
            seq_len, params["original_max_position_embeddings"], steps, method.length_dependent
        )
        inv_freq, attention_factor = checked_frequencies(method, rotary_dim, rope["rope_theta"], params, length)
        return inv_freq.to(device=device, dtype=torch.float32), attention_factor

    compute_rope_parameters.__name__ = f"compute_{_normalized_rope_type(rope_type).replace('.', '_').replace('-', '_')}"
    return compute_rope_parameters


def _register_rope_type(rope_type: str) -> None:
    existing = compat.ROPE_INIT_FUNCTIONS.get(rope_type)
    if existing is not None and not getattr(existing, "_hf_rope_ext", False):
        raise ValueError(f"transformers already defines rope_type {rope_type!r}; rename the method.")
    function = _transformers_init_function(rope_type)
    function._hf_rope_ext = True
    compat.ROPE_INIT_FUNCTIONS[rope_type] = function


def register_with_transformers(method: RopeMethod) -> None:
    """Let ``from_pretrained`` build models whose config names one of our rope types.

    Adds an entry to transformers' ``ROPE_INIT_FUNCTIONS`` (its documented extension point);
    never replaces an entry that is not ours.
    """
    if method.transformers_rope_type is not None:
        return
    for rope_type in _rope_type_spellings(method):
        _register_rope_type(rope_type)


def _rope_type_spellings(method: RopeMethod) -> list[str]:
    """The rope_type as written, and without its install hint: a user who cleans up the odd-looking
    string gets the same frequencies (:func:`verify_record` reads both as one type)."""
    return list(dict.fromkeys((custom_rope_type(method), _bare_rope_type(method))))


def unregister_from_transformers(method: RopeMethod) -> None:
    for rope_type in _rope_type_spellings(method):
        if getattr(compat.ROPE_INIT_FUNCTIONS.get(rope_type), "_hf_rope_ext", False):
            del compat.ROPE_INIT_FUNCTIONS[rope_type]


class _KnownRopeTypeFilter(logging.Filter):
    """Drops transformers' "Missing validation function ... for 'rope_type'='hf_rope_ext...'" warning
    for this package's registered rope types.

    transformers logs it for every rope type it has no validator for. For ours the message shows
    the rope_type string with its install hint ("needs `pip install hf-rope-ext` and `import
    hf_rope_ext`"), which reads as if the package were missing while it is imported and checks the
    config itself (:func:`verify_record` when the model is built). Types that are not registered
    in this process keep the warning.
    """

    _MARKER = "Missing validation function"

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self._MARKER not in message or f"'rope_type'='{CUSTOM_ROPE_TYPE_PREFIX}" not in message:
            return True
        rope_type = message.split("'rope_type'='", 1)[1].rstrip("'")
        try:
            method_from_rope_type(rope_type)
        except ValueError:
            return True
        logger.debug("rope_type %r is validated by hf_rope_ext (transformers has no validator for it).", rope_type)
        return False


logging.getLogger("transformers.modeling_rope_utils").addFilter(_KnownRopeTypeFilter())
