"""How a patch is written into a transformers config, and read back.

Convention for the context length fields (the same in memory and in saved ``config.json``):

* ``rope_parameters`` describes the patched frequencies in transformers' own vocabulary
  whenever transformers has the method (``linear``, ``dynamic``, ``yarn``, ``llama3``,
  ``longrope``; ``ntk`` is plain RoPE with a raised ``rope_theta``), so plain transformers
  and vLLM rebuild the same frequencies without this package.
* ``rope_parameters["original_max_position_embeddings"]`` holds the context the model was
  trained on wherever transformers accepts that key (yarn, llama3, longrope and this package's
  own types).
* ``max_position_embeddings`` is the extended context (original x scale) for static methods.
  Length-dependent methods keep the original value there, because transformers' ``dynamic``
  and vLLM read ``max_position_embeddings`` as the length where dynamic scaling starts.
* ``config.hf_rope_ext`` records the patch (method, scale, parameters, original context and
  ``rope_theta``) so a saved checkpoint can be re-patched exactly and described in a model card.

Methods transformers lacks are written as ``rope_type = "hf_rope_ext.<method>"`` and registered
in transformers' ``ROPE_INIT_FUNCTIONS`` when this package is imported. Without the package,
transformers stops at load time with ``KeyError: 'hf_rope_ext.<method>'``, never with silently
wrong frequencies.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import torch

from . import compat
from .methods import COMMON_PARAMS, RopeMethod, get_method, list_methods, resolve_params

logger = logging.getLogger(__name__)

RECORD_ATTRIBUTE = "hf_rope_ext"
CUSTOM_ROPE_TYPE_PREFIX = "hf_rope_ext."


def custom_rope_type(method: RopeMethod) -> str:
    """The ``rope_type`` string for a method transformers does not have.

    transformers recomputes frequencies on every call only for rope types whose name contains
    "dynamic", so length-dependent methods must carry that word.
    """
    name = method.name
    if method.length_dependent and "dynamic" not in name:
        name = f"dynamic.{name}"
    return CUSTOM_ROPE_TYPE_PREFIX + name


def method_from_rope_type(rope_type: str) -> RopeMethod | None:
    """Inverse of :func:`custom_rope_type`; None for transformers' own types."""
    if not rope_type.startswith(CUSTOM_ROPE_TYPE_PREFIX):
        return None
    for name in list_methods():
        method = get_method(name)
        if method.transformers_rope_type is None and custom_rope_type(method) == rope_type:
            return method
    raise ValueError(
        f"rope_type {rope_type!r} names an hf_rope_ext method that is not registered in this process; "
        "register it with hf_rope_ext.register_method before loading."
    )


def _json_value(value: Any) -> Any:
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
    ``rope_parameters`` to keep (``partial_rotary_factor``).
    """
    scale = params["factor"]
    original = int(params["original_max_position_embeddings"])
    extended = int(math.ceil(original * scale))
    native = method.transformers_rope_type
    own = {key: _json_value(value) for key, value in params.items() if key not in COMMON_PARAMS and value is not None}

    if native == "default":  # ntk: plain RoPE with the raised base the method computes
        scaled_base = base * scale ** (rotary_dim / (rotary_dim - 2))
        rope = {"rope_type": "default", "rope_theta": scaled_base}
    elif native == "linear":
        rope = {"rope_type": "linear", "rope_theta": base, "factor": scale}
    elif native == "dynamic":
        rope = {"rope_type": "dynamic", "rope_theta": base, "factor": scale}
    elif native == "longrope":
        half = rotary_dim // 2
        rope = {
            "rope_type": "longrope",
            "rope_theta": base,
            "factor": scale,
            "original_max_position_embeddings": original,
            "long_factor": own["long_factor"],
            "short_factor": own.get("short_factor", [1.0] * half),
        }
        if "attention_factor" in own:
            rope["attention_factor"] = float(own["attention_factor"])
    elif native in ("yarn", "llama3"):
        rope = {"rope_type": native, "rope_theta": base, "factor": scale, "original_max_position_embeddings": original}
        rope.update(own)
        if "attention_factor" in rope:
            rope["attention_factor"] = float(rope["attention_factor"])  # transformers wants a float
    else:
        rope = {
            "rope_type": custom_rope_type(method),
            "rope_theta": base,
            "factor": scale,
            "original_max_position_embeddings": original,
            **own,
        }
    rope.update(extra)
    max_positions = original if method.length_dependent else extended
    return rope, max_positions


def patch_record(
    method: RopeMethod, params: Mapping[str, Any], base: float, steps_per_doubling: int | None
) -> dict[str, Any]:
    """The ``config.hf_rope_ext`` entry: enough to rebuild the patch exactly."""
    from . import __version__

    record = {
        "method": method.name,
        "scale": params["factor"],
        "original_max_position_embeddings": int(params["original_max_position_embeddings"]),
        "original_rope_theta": base,
        "params": {key: _json_value(value) for key, value in params.items() if key not in COMMON_PARAMS},
        "version": __version__,
    }
    if method.length_dependent:
        record["steps_per_doubling"] = steps_per_doubling
    return record


# ----------------------------------------------------------------------------------------------
# transformers-side loading of this package's own rope types
# ----------------------------------------------------------------------------------------------


def _transformers_init_function(rope_type: str):
    """A function with transformers' rope-init signature for one of our rope types."""

    def compute_rope_parameters(config, device=None, seq_len=None, layer_type=None):
        method = method_from_rope_type(rope_type)
        rope = compat.rope_parameters(config)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary_dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
        given = {key: rope[key] for key in method.defaults if key in rope}
        params = resolve_params(method, rotary_dim, given)
        params["factor"] = rope["factor"]
        params["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
        length = int(seq_len) if seq_len is not None else None
        inv_freq, attention_factor = method.compute(rotary_dim, rope["rope_theta"], params, length)
        return inv_freq.to(device=device, dtype=torch.float32), attention_factor

    compute_rope_parameters.__name__ = f"compute_{rope_type.replace('.', '_').replace('-', '_')}"
    return compute_rope_parameters


def register_with_transformers(method: RopeMethod) -> None:
    """Let ``from_pretrained`` build models whose config names one of our rope types.

    Adds an entry to transformers' ``ROPE_INIT_FUNCTIONS`` (its documented extension point);
    never replaces an entry that is not ours.
    """
    if method.transformers_rope_type is not None:
        return
    rope_type = custom_rope_type(method)
    existing = compat.ROPE_INIT_FUNCTIONS.get(rope_type)
    if existing is not None and not getattr(existing, "_hf_rope_ext", False):
        raise ValueError(f"transformers already defines rope_type {rope_type!r}; rename the method.")
    function = _transformers_init_function(rope_type)
    function._hf_rope_ext = True
    compat.ROPE_INIT_FUNCTIONS[rope_type] = function


def unregister_from_transformers(method: RopeMethod) -> None:
    rope_type = custom_rope_type(method)
    if getattr(compat.ROPE_INIT_FUNCTIONS.get(rope_type), "_hf_rope_ext", False):
        del compat.ROPE_INIT_FUNCTIONS[rope_type]


def read_record(config: Any) -> dict[str, Any] | None:
    record = getattr(config, RECORD_ATTRIBUTE, None)
    return dict(record) if isinstance(record, Mapping) else None


def method_of_record(record: Mapping[str, Any]) -> RopeMethod:
    return get_method(record["method"])
