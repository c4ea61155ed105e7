"""The vLLM and llama.cpp settings that run a patch: one small translator per method and runtime.

(Over 400 lines: every method's translation for both runtimes, with the sources they follow.)

    from hf_rope_ext.runtimes import runtime_settings
    print(runtime_settings(model).format())    # vLLM and llama.cpp flags of a patched model

A method's translators are found through the registry (``RopeMethod.runtimes``, see
:func:`hf_rope_ext.methods.register_method`): the built-in ones point here, a user method can
declare its own; a runtime without one is reported as unsupported. Numbers come from the
method's own functions in :mod:`hf_rope_ext.methods` (YaRN's temperature, the NTK bases).

Sources read: vLLM ``vllm/config/model.py`` (``_get_and_verify_max_len``) and
``vllm/model_executor/layers/rotary_embedding/__init__.py`` (``get_rope``); llama.cpp
``convert_hf_to_gguf.py``, ``ggml_rope_yarn_corr_dims`` and ``src/llama-context.cpp``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from . import compat, config_io
from .families import check_supported
from .methods import (
    COMMON_PARAMS,
    LOGN_SUFFIX,
    RUNTIMES,
    checked_frequencies,
    dynamic_ntk_base,
    get_method,
    ntk_base,
    yarn_mscale,
)
from .spec import NOT_GIVEN, PatchSpec
from .validation import is_real

logger = logging.getLogger(__name__)

__all__ = [
    "RuntimeCommand",
    "RuntimeSettings",
    "describe_patch",
    "gguf_arch",
    "llama_cpp_command",
    "runtime_settings",
    "vllm_command",
]

# transformers model_type -> llama.cpp GGUF architecture name (convert_hf_to_gguf.py converts
# Mistral checkpoints with its Llama class); the names are gguf-py's MODEL_ARCH_NAMES.
_GGUF_ARCH = {
    "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe", "gpt_neox": "gptneox", "phi": "phi2", "phi3": "phi3", "stablelm": "stablelm",
    "gemma": "gemma", "granite": "granite", "olmo2": "olmo2", "starcoder2": "starcoder2",
}  # fmt: skip


@dataclass(frozen=True)
class RuntimeCommand:
    """How to run one patch in one runtime.

    ``status`` is ``"exact"`` (same frequencies as the patch), ``"approximate"`` (the closest
    setting the runtime has; ``notes`` say where it differs) or ``"unsupported"``.
    """

    runtime: str
    status: str
    args: tuple[str, ...] = ()
    settings: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @property
    def command_line(self) -> str:
        return shlex.join(self.args)

    def to_dict(self) -> dict[str, Any]:
        return {
            "runtime": self.runtime,
            "status": self.status,
            "args": list(self.args),
            "settings": self.settings,
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class RuntimeSettings:
    """The vLLM and llama.cpp equivalents of one patch (see :func:`runtime_settings`)."""

    method: str
    scale: float
    original_context: int
    extended_context: int
    vllm: RuntimeCommand
    llama_cpp: RuntimeCommand

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "scale": self.scale,
            "original_context": self.original_context,
            "extended_context": self.extended_context,
            "vllm": self.vllm.to_dict(),
            "llama_cpp": self.llama_cpp.to_dict(),
        }

    def format(self, model: str = "MODEL", gguf: str = "MODEL.gguf") -> str:
        lines = [
            f"{self.method}, scale {self.scale:g}: context {self.original_context} -> {self.extended_context} tokens",
            "",
            f"vLLM ({self.vllm.status}):",
        ]
        if self.vllm.args:
            lines.append("  " + shlex.join(["vllm", "serve", model, *self.vllm.args]))
        lines += [f"  - {note}" for note in self.vllm.notes]
        lines += ["", f"llama.cpp ({self.llama_cpp.status}):"]
        if self.llama_cpp.args:
            lines.append("  " + shlex.join(["llama-cli", "-m", gguf, *self.llama_cpp.args]))
        metadata = self.llama_cpp.settings.get("gguf_metadata", {})
        if metadata:
            lines.append("  GGUF metadata: " + ", ".join(f"{key}={value}" for key, value in metadata.items()))
        lines += [f"  - {note}" for note in self.llama_cpp.notes]
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Which patch
# ----------------------------------------------------------------------------------------------


def describe_patch(
    method: str,
    scale: float,
    *,
    original_max_length: int,
    rope_theta: float,
    rotary_dim: int,
    steps_per_doubling: Any = NOT_GIVEN,
    partial_rotary_factor: float | None = None,
    **params: Any,
) -> PatchSpec:
    """A patch described by its numbers alone (no model), for :func:`runtime_settings`.

    Arguments mean what they mean for :func:`hf_rope_ext.patch_model`; ``rope_theta`` and
    ``rotary_dim`` are the base model's RoPE base and rotated dimensions per head.
    """
    _check_method_name(method)
    kept = {}
    if partial_rotary_factor is not None:
        if not (is_real(partial_rotary_factor) and 0 < partial_rotary_factor <= 1):
            raise ValueError(
                f"partial_rotary_factor must be a number with 0 < factor <= 1 (the fraction of each head that is "
                f"rotated), got {partial_rotary_factor!r}; leave it out when the whole head is rotated."
            )
        kept = {"partial_rotary_factor": float(partial_rotary_factor)}
    return PatchSpec.create(
        method,
        scale,
        original_max_length=original_max_length,
        steps_per_doubling=steps_per_doubling,
        rope_theta=rope_theta,
        rotary_dim=rotary_dim,
        kept=kept,
        **params,
    )


def _check_method_name(method: Any) -> None:
    if isinstance(method, str) and method.strip() == LOGN_SUFFIX:
        raise ValueError(
            f"method {method!r} is only the suffix that adds log-n attention to a method; give the method with it, "
            f"e.g. 'yarn{LOGN_SUFFIX}'."
        )


def _patch_of(
    source: Any, method: str | None, scale: float | None, patch_kwargs: dict[str, Any]
) -> tuple[PatchSpec, str | None]:
    if isinstance(source, PatchSpec):
        if method is not None or scale is not None or patch_kwargs:
            raise ValueError("Give method/scale/parameters or a described patch, not both.")
        if source.original_rope_theta is None or source.rotary_dim is None:
            raise ValueError(
                "This patch has no rope_theta/rotary_dim; describe it with describe_patch(...) or pass the patched "
                "model."
            )
        return source, None
    config = getattr(source, "config", source) if isinstance(source, nn.Module) else source
    model_type = getattr(config, "model_type", None)
    check_supported(model_type, config)  # what patch_model refuses, with its message
    if not hasattr(config, "rope_parameters"):
        raise TypeError(
            "runtime_settings expects a model, a transformers config or describe_patch(...), got "
            f"{type(source).__name__}."
        )
    patched = config_io.read_record(config) is not None
    if patched and (method is not None or scale is not None or patch_kwargs):
        raise ValueError(
            "This config is already patched; its settings need no method, scale or parameters. To describe another "
            "patch, pass the original model's config with method= and scale=."
        )
    scaled = None if patched else compat.already_scaled_message(
        model_type, compat.rope_parameters(config), getattr(config, "max_position_embeddings", "?"))
    if method is None:
        if scale is not None or patch_kwargs:
            raise ValueError("scale and method parameters need method= as well.")
        recorded = config_io.verify_record(config)
        if recorded is None and scaled is not None:
            raise ValueError(scaled)
        if recorded is None:
            raise ValueError(
                f"This {model_type!r} config has no hf_rope_ext record; give method= and scale= to describe a patch "
                "of this (unpatched) model."
            )
        return recorded, model_type
    if scaled is not None:
        raise ValueError(scaled)
    _check_method_name(method)
    rope = compat.rope_parameters(config)
    if scale is None:
        raise ValueError("runtime_settings needs scale= together with method=.")
    facts = [name for name in ("rope_theta", "rotary_dim", "partial_rotary_factor") if name in patch_kwargs]
    if facts:
        raise ValueError(f"{', '.join(facts)} come(s) from the config; describe another model with describe_patch(...).")
    original = patch_kwargs.pop("original_max_length", None)
    if original is None:  # not `or`: 0 is refused, as by describe_patch
        original = config.max_position_embeddings
    rotary_dim = config_io.rotary_dim_of(config, rope)  # a config alone: as the family's module rotates
    if isinstance(source, nn.Module) and "partial_rotary_factor" in rope:  # patch_model reads the module's
        from .patching import find_rotary_module

        rotary_dim = 2 * find_rotary_module(source)[1].inv_freq.shape[-1]
    kept = config_io.kept_rope_fields(config, rope, rotary_dim)
    patch = describe_patch(
        method,
        scale,
        original_max_length=original,
        rope_theta=rope["rope_theta"],
        rotary_dim=rotary_dim,
        partial_rotary_factor=kept.get("partial_rotary_factor"),
        **patch_kwargs,
    )
    # The config class may accept only some rope types (Phi-3: longrope): patch_model writes
    # the new rope through this check, so a patch it would refuse is refused here too.
    compat.write_rope_config(copy.deepcopy(config), *_rope_as(patch))
    return patch, model_type


def runtime_settings(
    source: Any,
    method: str | None = None,
    scale: float | None = None,
    *,
    model_type: str | None = None,
    **patch_kwargs: Any,
) -> RuntimeSettings:
    """The vLLM and llama.cpp settings equivalent to a patch.

    ``source`` is a patched model, the config of one (a checkpoint saved with this package),
    a :func:`describe_patch` result, or an unpatched model/config together with ``method``,
    ``scale`` and optional ``original_max_length``, ``steps_per_doubling`` and method
    parameters (the patch :func:`hf_rope_ext.patch_model` would apply). ``model_type`` names
    the GGUF architecture when ``source`` carries none.

    Where a runtime has no such method the result says so (``status="unsupported"``), or
    gives the closest static setting and explains the difference (``"approximate"``).
    """
    if model_type is not None and not isinstance(model_type, str):
        raise TypeError(f"model_type must be a transformers model_type string such as 'llama', got {model_type!r}.")
    patch, found_type = _patch_of(source, method, scale, dict(patch_kwargs))
    if patch.rotary_dim is not None and patch.original_rope_theta is not None:
        # What patch_model checks: finite, positive frequencies at the extended context (a huge
        # rope_theta overflows ntk's raised base to inf, which no runtime can be given).
        checked_frequencies(patch.rope_method, patch.rotary_dim, patch.original_rope_theta, patch.resolved_params(),
                            patch.extended_context)  # fmt: skip
        _check_float32_base(patch)
    if model_type is not None and model_type != found_type:
        _check_model_type(model_type, patch)
    model_type = model_type or found_type
    vllm, llama_cpp = (_translate(patch, runtime, model_type) for runtime in RUNTIMES)
    if not isinstance(source, (PatchSpec, nn.Module)) and config_io.read_record(source) is not None:
        vllm = _without_saved_attn_factor(vllm, source)  # a saved checkpoint's config: say what it holds
    if patch.logn_attention:
        vllm, llama_cpp = _without_logn(vllm), _without_logn(llama_cpp)
    return RuntimeSettings(
        method=patch.method + (LOGN_SUFFIX if patch.logn_attention else ""),
        scale=patch.scale,
        original_context=patch.original_max_position_embeddings,
        extended_context=patch.extended_context,
        vllm=vllm,
        llama_cpp=llama_cpp,
    )


def _check_float32_base(patch: PatchSpec) -> None:
    """Refuse a RoPE base that the runtimes' float32 cannot hold (llama.cpp's --rope-freq-base and
    GGUF freq_base, vLLM's rotary cache): the settings printed would overflow to inf there."""
    bases = {"rope_theta": patch.original_rope_theta}
    if patch.method == "ntk":  # the raised bases the settings print
        bases["the NTK base"] = ntk_base(patch.original_rope_theta, patch.scale, patch.rotary_dim)
    elif patch.method == "dynamic":
        bases["the NTK base at the full length"] = _full_length_ntk_base(patch)
    for name, value in bases.items():
        if value > _FLOAT32_MAX:
            raise ValueError(
                f"{name} of this {patch.method} x{patch.scale:g} patch is {value:.6g}, beyond float32 "
                f"({_FLOAT32_MAX:.4g}), which vLLM and llama.cpp compute RoPE in; use a smaller rope_theta or scale."
            )


_FLOAT32_MAX = 3.4028234663852886e38


def _check_model_type(model_type: str, patch: PatchSpec) -> None:
    """Refuse a patch that patch_model would refuse on a model of ``model_type`` given by name:
    an unsupported family, or a rope type its config class rejects (Phi-3: longrope only)."""
    check_supported(model_type)
    from transformers import AutoConfig

    try:
        config = AutoConfig.for_model(model_type)  # the class's defaults; its validator is what matters
        heads = getattr(config, "num_attention_heads", None)
        if not isinstance(heads, int) or not all(hasattr(config, name) for name in ("rope_parameters", "max_position_embeddings")):
            return  # no RoPE config to check against
        # Rotary dimensions as described, so that validators which count frequency factors agree.
        config.hidden_size = patch.rotary_dim * heads
        if "head_dim" in vars(config):  # (a property on some classes: Falcon's)
            config.head_dim = patch.rotary_dim
        if hasattr(config, "original_max_position_embeddings"):  # Phi-3's default (4096) would warn of a mismatch
            config.original_max_position_embeddings = patch.original_max_position_embeddings
    except Exception:  # noqa: BLE001 - a type transformers does not know, or whose defaults cannot be set up
        # like this (recurrent_gemma, gemma4): only its GGUF key names are used, as before this check
        return
    parameters, length = _rope_as(patch)
    compat.write_rope_config(config, {"partial_rotary_factor": 1.0, **parameters}, length)


def _translate(patch: PatchSpec, runtime: str, model_type: str | None) -> RuntimeCommand:
    method = patch.rope_method
    translator = method.translator(runtime)
    if translator is None and runtime == "vllm" and method.transformers_rope_type is not None:
        translator = _vllm_native  # a user method that transformers (so vLLM) knows by its rope type
    if translator is None:
        return _unsupported(patch, runtime)
    command = translator(patch, model_type)
    if not isinstance(command, RuntimeCommand):
        raise TypeError(
            f"The {runtime} translator of method {method.name!r} returned {type(command).__name__}; it must return "
            "a hf_rope_ext.runtimes.RuntimeCommand."
        )
    return command


def _unsupported(patch: PatchSpec, runtime: str) -> RuntimeCommand:
    name = patch.method
    if patch.rope_method.attention is not None:
        return RuntimeCommand(runtime, "unsupported", notes=(_ATTENTION_NOTES[runtime].format(name=name),))
    if runtime == "vllm":
        note = (
            f"vLLM cannot run the user-registered method {name!r}: it builds only its own rope types "
            "(get_rope in vllm/model_executor/layers/rotary_embedding/__init__.py raises 'Unknown RoPE scaling type')."
        )
    else:
        note = (
            f"llama.cpp cannot run the user-registered method {name!r}. Its converter (convert_hf_to_gguf.py) "
            "logs 'Unknown RoPE type' for such a checkpoint and writes plain RoPE."
        )
    return RuntimeCommand(runtime, "unsupported", notes=(note,))


_ATTENTION_NOTES = {
    "vllm": (
        "vLLM has no {name} attention setting for this checkpoint (its dual-chunk attention backend serves only "
        "Qwen2 checkpoints that carry Qwen's own dual_chunk_attention_config, which hf_rope_ext does not write, and "
        "was not run here with this patch's positions); serve the base model within its original context, or use a frequency "
        "method (yarn)."
    ),
    "llama.cpp": "llama.cpp has no {name} attention setting for converted checkpoints.",
}


def _without_logn(command: RuntimeCommand) -> RuntimeCommand:
    """Log-n attention has no setting in either runtime: the rest of the patch is what they run."""
    note = (
        "log-n attention (logits x max(1, ln(i + 1) / ln(L0)) beyond the original context) has no setting here; "
        "these settings run the patch without it."
    )
    status = "approximate" if command.status == "exact" else command.status
    return RuntimeCommand(command.runtime, status, command.args, command.settings, (*command.notes, note))


def _stand_in_note(patch: PatchSpec, static: str) -> str:
    """Why the static ``static`` method differs from a length-dependent patch."""
    s, n, original = patch.scale, patch.extended_context, patch.original_max_position_embeddings
    if static == "yarn":
        return (
            f"No runtime has dynamic YaRN. Closest: static yarn at scale {s:g}, which equals this patch for inputs of "
            f"{n} tokens; shorter inputs get more interpolation than the patch gives them (the patch is the original "
            f"model up to {original} tokens)."
        )
    return (
        "No runtime has length-dependent linear interpolation. "
        f"Closest: linear at scale {s:g}, equal to this patch for inputs of {n} tokens; the patch is the "
        f"original model up to {original} tokens, static linear compresses every input."
    )


def _full_length_ntk_base(patch: PatchSpec) -> float:
    # Dynamic NTK's base at the full extended length, from the method's own formula.
    return dynamic_ntk_base(
        patch.original_rope_theta, patch.scale, patch.extended_context, patch.original_max_position_embeddings,
        patch.rotary_dim,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# vLLM
# ----------------------------------------------------------------------------------------------

_VLLM_LINEAR_NOTE = (
    "vLLM derives the maximum length of `linear` as max_position_embeddings x factor; --max-model-len sets "
    "the real one."
)


_CHECKPOINT_HOLDS = "A checkpoint saved with hf_rope_ext already holds these settings"


def _without_saved_attn_factor(command: RuntimeCommand, config: Any) -> RuntimeCommand:
    """``command`` for a patched config whose RoPE fields lack the legacy ``attn_factor`` that the
    overrides carry (a yarn checkpoint saved before hf_rope_ext wrote it): the checkpoint alone does
    not give older vLLM releases its attention_factor, so the note must not say it does."""
    overrides = command.settings.get("hf_overrides", {}).get("rope_parameters", {})
    if "attn_factor" not in overrides or "attn_factor" in compat.rope_parameters(config):
        return command
    note = (
        "This checkpoint's config.json has no attn_factor (saved by an earlier hf_rope_ext, or with "
        "legacy_fields=False): vLLM 0.32 reads its attention_factor, but older releases read only attn_factor and "
        "would use their default scale. Serve it with the --hf-overrides above (legacy_hf_overrides on releases built "
        f"on transformers 4.x), or re-save it with hf_rope_ext.hub.save_patched, which writes "
        f"attn_factor={overrides['attn_factor']:.6g}."
    )
    notes = tuple(note if text.startswith(_CHECKPOINT_HOLDS) else text for text in command.notes)
    return dataclasses.replace(command, notes=notes)


def vllm_command(
    patch: PatchSpec,
    rope: Mapping[str, Any],
    max_positions: int,
    *,
    status: str = "exact",
    notes: Iterable[str] = (),
    checkpoint_note: str | None = None,
) -> RuntimeCommand:
    """``vllm serve --max-model-len N --hf-overrides {...}`` with these ``rope_parameters`` and
    ``max_position_embeddings``; ``notes`` first, then how the overrides relate to a saved
    checkpoint (``checkpoint_note`` replaces the default one) and to older vLLM releases."""
    notes = list(notes)
    if checkpoint_note is None and patch.rope_method.transformers_rope_type is None:
        checkpoint_note = (
            f"vLLM cannot load a checkpoint with rope_type {config_io.custom_rope_type(patch.rope_method)!r}; serve "
            "the base model with these overrides."
        )
    notes.append(checkpoint_note or (
        f"{_CHECKPOINT_HOLDS}: `vllm serve CHECKPOINT "
        f"--max-model-len {patch.extended_context}` is enough; --hf-overrides applies them to the base model."
    ))  # fmt: skip
    notes.append(
        "vLLM releases built on transformers 4.x read `rope_scaling` and `rope_theta` instead of `rope_parameters`; "
        "`hf-rope-ext runtimes --json` prints those overrides as legacy_hf_overrides."
    )
    rope = dict(rope)
    overrides = {"rope_parameters": rope, "max_position_embeddings": max_positions}
    legacy = {**config_io.legacy_fields(rope), "max_position_embeddings": max_positions}
    args = (
        "--max-model-len",
        str(patch.extended_context),
        "--hf-overrides",
        json.dumps(overrides, separators=(",", ":")),
    )
    settings = {"max_model_len": patch.extended_context, "hf_overrides": overrides, "legacy_hf_overrides": legacy}
    return RuntimeCommand("vllm", status, args, settings, tuple(notes))


def _rope_as(patch: PatchSpec, method: str | None = None) -> tuple[dict[str, Any], int]:
    """``rope_parameters`` and ``max_position_embeddings`` of the patch written as ``method``."""
    rope_method = get_method(method) if method else patch.rope_method
    params = patch.resolved_params()
    if rope_method is not patch.rope_method:  # a stand-in: only the parameters it has
        params = {key: value for key, value in params.items() if key in rope_method.defaults or key in COMMON_PARAMS}
    return config_io.rope_config_for(rope_method, params, patch.original_rope_theta, patch.rotary_dim, patch.kept)


def _vllm_native(patch: PatchSpec, model_type: str | None = None) -> RuntimeCommand:
    return vllm_command(patch, *_rope_as(patch))


vllm_ntk = vllm_llama3 = _vllm_native


def vllm_linear(patch: PatchSpec, model_type: str | None = None) -> RuntimeCommand:
    return vllm_command(patch, *_rope_as(patch), notes=[_VLLM_LINEAR_NOTE])


def vllm_dynamic_linear(patch: PatchSpec, model_type: str | None = None) -> RuntimeCommand:
    notes = [_stand_in_note(patch, "linear"), _VLLM_LINEAR_NOTE]
    return vllm_command(patch, *_rope_as(patch, "linear"), status="approximate", notes=notes)


def _vllm_yarn(patch: PatchSpec, status: str, notes: list[str]) -> RuntimeCommand:
    rope, max_positions = _rope_as(patch, "yarn")
    params = patch.resolved_params()
    if params.get("attention_factor") is not None:
        # Both spellings, each read by some vLLM release: vLLM 0.32.0's get_rope passes
        # `attention_factor` to its YaRN and uses it as the scale itself (checked by running it,
        # scripts/check_vllm.py); earlier releases passed only `attn_factor`, multiplied by their
        # own 0.1 ln(s) + 1. A release reads one of the two, so either way the scale is ours.
        rope["attn_factor"] = config_io.legacy_attn_factor(rope)
        notes.append(
            f"attention_factor={params['attention_factor']} is also written as attn_factor={rope['attn_factor']:.6g} "
            "in the overrides: vLLM 0.32 reads attention_factor, older releases attn_factor x (0.1 ln s + 1); both "
            "give the same scale."
        )
    if not params.get("truncate", True):
        status = "approximate"
        notes.append("truncate=false is honoured only by vLLM releases whose YaRN takes `truncate`; older ones round.")
    return vllm_command(patch, rope, max_positions, status=status, notes=notes)


def vllm_yarn(patch: PatchSpec, model_type: str | None = None) -> RuntimeCommand:
    return _vllm_yarn(patch, "exact", [])


def vllm_dynamic_yarn(patch: PatchSpec, model_type: str | None = None) -> RuntimeCommand:
    return _vllm_yarn(patch, "approximate", [_stand_in_note(patch, "yarn")])


def vllm_dynamic(patch: PatchSpec, model_type: str | None = None) -> RuntimeCommand:
    # Pin the full-length frequencies as plain RoPE: vLLM's own `dynamic` is static and its
    # formula changed between releases (vllm-project/vllm issue 41236, PR 41277).
    full_base = _full_length_ntk_base(patch)
    rope = {"rope_type": "default", "rope_theta": full_base, **patch.kept}
    note = (
        "vLLM has no length-dependent NTK scaling: its `dynamic` computes one base for all requests, and that base "
        "changed between releases (before vllm-project/vllm PR 41277 it was the base of the full length). These "
        f"overrides pin that: plain RoPE with the NTK base dynamic scaling reaches at {patch.extended_context} "
        f"tokens, {full_base:.6g}, for every request; the patch keeps the original RoPE up to "
        f"{patch.original_max_position_embeddings} tokens and scales with the current length beyond."
    )
    return vllm_command(
        patch, rope, patch.extended_context, status="approximate", notes=[note],
        checkpoint_note="Serving a saved `dynamic` checkpoint directly uses vLLM's own `dynamic`; use these overrides.",
    )  # fmt: skip


def vllm_longrope(patch: PatchSpec, model_type: str | None = None) -> RuntimeCommand:
    rope, max_positions = _rope_as(patch)
    status, notes = "exact", []
    _, attention = patch.rope_method.compute(patch.rotary_dim, patch.original_rope_theta, patch.resolved_params(), None)
    # vLLM derives the attention factor from max_position_embeddings / original instead of `factor`.
    rope["short_mscale"] = rope["long_mscale"] = float(attention)
    if rope["short_factor"] != rope["long_factor"]:
        original = patch.original_max_position_embeddings
        status = "approximate"
        notes.append(
            f"vLLM uses long_factor for every request once --max-model-len exceeds {original} "
            f"(Phi3LongRoPEScaledRotaryEmbedding); the patch uses short_factor for inputs up to {original} tokens. "
            "Outputs agree for longer inputs."
        )
    return vllm_command(patch, rope, max_positions, status=status, notes=notes)


def _dca_stand_in_note(patch: PatchSpec) -> str:
    """How static yarn at the patch's scale differs from a ``dynamic-yarn-dca`` patch."""
    settle = patch.rope_method.settle_length(patch.resolved_params())
    below = "dynamic yarn" if patch.method == "dynamic-yarn-dca" else "self-extend on the trained frequencies"
    beyond = "self-extend" if patch.method == "self-extend-yarn" else "dual chunk attention"
    closest = f"Closest: static yarn at scale {patch.scale:g}; the patch is the original model up to " \
              f"{patch.original_max_position_embeddings} tokens"  # fmt: skip
    if settle >= patch.extended_context:  # the context ends before the frequencies change
        return (
            f"No runtime has {below} for this architecture. {closest} and {below} up to {patch.extended_context}."
        )
    return (
        f"No runtime has {beyond} with these positions for this architecture. {closest}, {below} up to {settle}, "
        f"and beyond that yarn x{patch.params['frequencies_scale']:g} with {beyond}."
    )


def vllm_dynamic_yarn_dca(patch: PatchSpec, model_type: str | None = None) -> RuntimeCommand:
    return _vllm_yarn(patch, "approximate", [_dca_stand_in_note(patch)])


def vllm_self_extend(patch: PatchSpec, model_type: str | None = None) -> RuntimeCommand:
    return _unsupported(patch, "vllm")


vllm_dual_chunk = vllm_self_extend


# ----------------------------------------------------------------------------------------------
# llama.cpp
# ----------------------------------------------------------------------------------------------


def gguf_arch(model_type: str | None) -> str:
    """llama.cpp's architecture name (the GGUF key prefix) for a transformers model type."""
    return _GGUF_ARCH.get(model_type or "", model_type or "llama")


def llama_cpp_command(
    patch: PatchSpec,
    model_type: str | None,
    flags: Mapping[str, Any],
    metadata: Mapping[str, Any] | None = None,
    *,
    status: str = "exact",
    notes: Iterable[str] = (),
) -> RuntimeCommand:
    """``llama-cli`` flags (``--ctx-size`` added) and GGUF metadata (``{arch}.context_length``
    added) running the patch; a note says when the architecture name is a guess, and when
    convert_hf_to_gguf.py cannot convert a checkpoint of the patch."""
    arch = gguf_arch(model_type)
    all_notes = [] if model_type in _GGUF_ARCH else [
        f"GGUF keys assume the architecture name {arch!r}; check general.architecture in your file."
    ]  # fmt: skip
    all_notes += notes
    if patch.rope_method.transformers_rope_type is None:
        all_notes.append(
            "convert_hf_to_gguf.py does not know this checkpoint's rope_type and writes plain RoPE: convert the base "
            "model and pass the flags above."
        )
    flags = {**flags, "--ctx-size": patch.extended_context}
    args = tuple(part for flag, value in flags.items() for part in (flag, _flag_text(value)))
    metadata = {f"{arch}.context_length": patch.extended_context, **(metadata or {})}
    return RuntimeCommand("llama.cpp", status, args, {"flags": flags, "gguf_metadata": metadata}, tuple(all_notes))


def _flag_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        return str(value)
    value = float(value)
    # Whole numbers as integers (--rope-freq-base 100000), but not huge ones (a 301-digit 1e300).
    return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)


def llama_cpp_ntk(patch: PatchSpec, model_type: str | None = None) -> RuntimeCommand:
    scaled = ntk_base(patch.original_rope_theta, patch.scale, patch.rotary_dim)
    flags = {"--rope-scaling": "none", "--rope-freq-base": scaled}
    return llama_cpp_command(patch, model_type, flags, {f"{gguf_arch(model_type)}.rope.freq_base": scaled})


def _llama_cpp_linear(patch: PatchSpec, model_type: str | None, status: str, notes: list[str]) -> RuntimeCommand:
    arch, base = gguf_arch(model_type), patch.original_rope_theta
    flags = {"--rope-scaling": "linear", "--rope-scale": patch.scale, "--rope-freq-base": base}
    metadata = {
        f"{arch}.rope.freq_base": base,
        f"{arch}.rope.scaling.type": "linear",
        f"{arch}.rope.scaling.factor": patch.scale,
    }
    return llama_cpp_command(patch, model_type, flags, metadata, status=status, notes=notes)


def llama_cpp_linear(patch: PatchSpec, model_type: str | None = None) -> RuntimeCommand:
    return _llama_cpp_linear(patch, model_type, "exact", [])


def llama_cpp_dynamic_linear(patch: PatchSpec, model_type: str | None = None) -> RuntimeCommand:
    return _llama_cpp_linear(patch, model_type, "approximate", [_stand_in_note(patch, "linear")])


def _llama_cpp_yarn(patch: PatchSpec, model_type: str | None, status: str, notes: list[str]) -> RuntimeCommand:
    arch, base, params = gguf_arch(model_type), patch.original_rope_theta, patch.resolved_params()
    original = patch.original_max_position_embeddings
    metadata: dict[str, Any] = {}
    attn_factor = 1.0
    if params.get("attention_factor") is not None:
        attn_factor = float(params["attention_factor"]) / yarn_mscale(patch.scale)
        notes.append(
            f"attention_factor={params['attention_factor']} becomes yarn attn_factor {attn_factor:.6g}: llama.cpp "
            "multiplies it by 0.1 ln(s) + 1. Releases after ggml-org/llama.cpp PR 17945 override "
            f"--yarn-attn-factor in YaRN mode and read the GGUF key {arch}.rope.scaling.attn_factor instead."
        )
        metadata[f"{arch}.rope.scaling.attn_factor"] = attn_factor
    if not params.get("truncate", True):
        status = "approximate"
        notes.append("llama.cpp always rounds the YaRN ramp ends (ggml_rope_yarn_corr_dims); truncate=false differs.")
    flags = {
        "--rope-scaling": "yarn",
        "--rope-scale": patch.scale,
        "--rope-freq-base": base,
        "--yarn-orig-ctx": original,
        "--yarn-ext-factor": 1.0,
        "--yarn-attn-factor": attn_factor,
        "--yarn-beta-fast": params["beta_fast"],
        "--yarn-beta-slow": params["beta_slow"],
    }
    metadata.update({
        f"{arch}.rope.freq_base": base,
        f"{arch}.rope.scaling.type": "yarn",
        f"{arch}.rope.scaling.factor": patch.scale,
        f"{arch}.rope.scaling.original_context_length": original,
        f"{arch}.rope.scaling.yarn_beta_fast": params["beta_fast"],
        f"{arch}.rope.scaling.yarn_beta_slow": params["beta_slow"],
    })
    return llama_cpp_command(patch, model_type, flags, metadata, status=status, notes=notes)


def llama_cpp_yarn(patch: PatchSpec, model_type: str | None = None) -> RuntimeCommand:
    return _llama_cpp_yarn(patch, model_type, "exact", [])


def llama_cpp_dynamic_yarn(patch: PatchSpec, model_type: str | None = None) -> RuntimeCommand:
    return _llama_cpp_yarn(patch, model_type, "approximate", [_stand_in_note(patch, "yarn")])


def llama_cpp_dynamic_yarn_dca(patch: PatchSpec, model_type: str | None = None) -> RuntimeCommand:
    return _llama_cpp_yarn(patch, model_type, "approximate", [_dca_stand_in_note(patch)])


vllm_self_extend_dca = vllm_self_extend_yarn = vllm_dynamic_yarn_dca
llama_cpp_self_extend_dca = llama_cpp_self_extend_yarn = llama_cpp_dynamic_yarn_dca


def llama_cpp_dynamic(patch: PatchSpec, model_type: str | None = None) -> RuntimeCommand:
    stand_in = _full_length_ntk_base(patch)
    note = (
        "llama.cpp has no dynamic NTK, and convert_hf_to_gguf.py ignores rope_type `dynamic` (a converted file "
        f"runs plain RoPE). Closest: the NTK base dynamic scaling reaches at {patch.extended_context} tokens, "
        f"{stand_in:.6g}, for every input (what vLLM does); the patch is the original model up to "
        f"{patch.original_max_position_embeddings} tokens."
    )
    flags = {"--rope-scaling": "none", "--rope-freq-base": stand_in}
    metadata = {f"{gguf_arch(model_type)}.rope.freq_base": stand_in}
    return llama_cpp_command(patch, model_type, flags, metadata, status="approximate", notes=[note])


def llama_cpp_llama3(patch: PatchSpec, model_type: str | None = None) -> RuntimeCommand:
    arch = gguf_arch(model_type)
    if arch != "llama":
        return RuntimeCommand("llama.cpp", "unsupported", notes=(
            "llama.cpp computes llama3 frequency factors only when converting Llama-architecture models; "
            f"a {model_type!r} checkpoint converts with plain RoPE.",
        ))  # fmt: skip
    note = (
        "No command-line flags express llama3 scaling: convert this checkpoint with convert_hf_to_gguf.py, which "
        "stores the per-frequency factors in a rope_freqs tensor; then only --ctx-size is needed."
    )
    return llama_cpp_command(patch, model_type, {}, {f"{arch}.rope.freq_base": patch.original_rope_theta}, notes=[note])


def llama_cpp_longrope(patch: PatchSpec, model_type: str | None = None) -> RuntimeCommand:
    arch = gguf_arch(model_type)
    if arch != "phi3":
        return RuntimeCommand("llama.cpp", "unsupported", notes=(
            "llama.cpp's converter (convert_hf_to_gguf.py) writes LongRoPE factors only for Phi-3 models "
            f"(rope_factors_long/short tensors); {model_type or 'this'!r} checkpoints convert without them.",
        ))  # fmt: skip
    # What Phi3MiniModel in convert_hf_to_gguf.py writes (read from its source, not run here): the
    # factors from rope_scaling, and its own attention factor from max_position_embeddings.
    original, base = patch.original_max_position_embeddings, patch.original_rope_theta
    params = patch.resolved_params()
    ratio = patch.extended_context / original
    converted_attention = math.sqrt(1 + math.log(ratio) / math.log(original)) if ratio > 1 else 1.0
    _, attention = patch.rope_method.compute(patch.rotary_dim, base, params, None)
    rope, _ = _rope_as(patch)
    status = "exact"
    notes = [
        "No command-line flags carry LongRoPE factors: convert the checkpoint saved with hf_rope_ext (with its "
        "rope_scaling, save_patched's default) with convert_hf_to_gguf.py. It stores long_factor and short_factor as "
        "the rope_factors_long/short tensors and the attention factor sqrt(1 + ln(s) / ln(L0)) as "
        f"{arch}.rope.scaling.attn_factor; then only --ctx-size is needed."
    ]
    if rope["short_factor"] != rope["long_factor"]:
        status = "approximate"
        notes.append(
            f"llama.cpp uses rope_factors_long for every input once --ctx-size exceeds {original}; the patch uses "
            f"short_factor for inputs up to {original} tokens. Outputs agree for longer inputs."
        )
    if not math.isclose(float(attention), converted_attention, rel_tol=1e-6):
        status = "approximate"
        notes.append(
            f"The converter ignores attention_factor={float(attention):g} and writes {converted_attention:.6g}; set "
            f"{arch}.rope.scaling.attn_factor to {float(attention):g} in the GGUF file for the patch's scale."
        )
    metadata = {f"{arch}.rope.freq_base": base, f"{arch}.rope.scaling.attn_factor": converted_attention}
    return llama_cpp_command(patch, model_type, {}, metadata, status=status, notes=notes)


def llama_cpp_self_extend(patch: PatchSpec, model_type: str | None = None) -> RuntimeCommand:
    remap = patch.rope_method.attention(patch.resolved_params())
    # llama.cpp's grouped attention: the same idea (group factor n, neighbour width w), applied by
    # shifting cached positions block by block; w must be a multiple of n there. It has one group
    # size: without a fixed one, the patch's group for the last position of the context.
    group = remap.group_for(patch.extended_context - 1)
    width = max(group, (remap.neighbor_window // group) * group)
    args = ("--grp-attn-n", str(group), "--grp-attn-w", str(width), "--ctx-size", str(patch.extended_context))
    # Found by running it (scripts/check_runtimes.py, README "Runtimes: checked by running them").
    broken = (
        "Not usable in llama.cpp as released: llama-cli's grouped attention (Self-Extend) moves cached positions "
        "with llama_memory_seq_div, and llama_kv_cells::pos_div records the key shift of that division with the "
        "wrong sign (p_old - p_new; pos_add records p_new - p_old), so regrouped keys are rotated away from their "
        "new positions. Measured with llama.cpp 0c1e570 (llama-cpp-python 0.3.36) on SmolLM2-135M, 12,288 tokens: "
        "perplexity 745 at 4k-8k and 5391 beyond 8k, against 24.4 and 32.8 for self-extend with its default "
        "parameters in transformers."
    )
    differs = (
        "The flags above are for a llama.cpp whose pos_div records p_new - p_old. Its scheme still differs from "
        f"this patch: one group factor and a width that must be a multiple of it ({width} here; the patch's "
        f"neighbour window is {remap.neighbor_window}), cached positions regrouped block by block during "
        "decoding instead of per query. With the sign fixed, llama.cpp read the same tokens at 24.67 (4k-8k) and "
        "33.91 (beyond 8k) on SmolLM2's Q4_1 file, 1.0% and 3.4% above self-extend with its default parameters; "
        "the scheme itself, redone in transformers on the same weights, is 0.6% and 2.7% above it."
    )
    notes = [broken, differs]
    # What the flags leave out: they run the trained frequencies with floor-grouped far positions.
    frequencies = patch.params.get("frequencies")
    if frequencies is not None:
        scale = patch.params.get("frequencies_scale") or patch.scale
        notes.append(
            f"This patch rotates with {frequencies} x{scale:g} frequencies (frequencies={frequencies!r}); the flags "
            "above keep the trained ones, and llama.cpp's grouped attention has no setting for both together."
        )
    if patch.params.get("far_positions") == "by-parts":
        notes.append(
            "This patch places far keys by YaRN's NTK-by-parts split (far_positions='by-parts': fast dimensions keep "
            "their true distance); llama.cpp's grouped attention floor-divides every dimension's position."
        )
    return RuntimeCommand("llama.cpp", "unsupported", args, {}, tuple(notes))


def llama_cpp_dual_chunk(patch: PatchSpec, model_type: str | None = None) -> RuntimeCommand:
    return _unsupported(patch, "llama.cpp")
