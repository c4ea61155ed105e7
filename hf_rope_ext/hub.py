"""Patched checkpoints: save, push to the Hub, load back, and run in vLLM or llama.cpp.

    from hf_rope_ext import patch_model
    from hf_rope_ext.hub import save_patched, load_patched, runtime_settings

    patch_model(model, scale=4, method="yarn")
    save_patched(model, "smollm2-yarn-32k", tokenizer=tokenizer)  # or push_patched_to_hub(...)
    model = load_patched("smollm2-yarn-32k")                       # the same patch, exactly
    print(runtime_settings(model).format())                        # vLLM and llama.cpp flags

What a saved checkpoint holds is described in :mod:`hf_rope_ext.config_io`. In short: methods
transformers has (linear, ntk, dynamic, yarn, llama3, longrope) load with plain
``AutoModelForCausalLM.from_pretrained``, without this package and without
``trust_remote_code``; the others (dynamic-yarn, dynamic-linear, user-registered methods)
load after ``import hf_rope_ext``, and fail without it with an error that says so.

``from_pretrained`` builds transformers' own rotary module from the scaled config. For
length-dependent methods that module follows transformers' ``dynamic`` update rules (no KV
cache correction; after a long input, a shorter one reuses stale state). :func:`load_patched`
(or :func:`restore_patch` on a loaded model) rebuilds this package's patch instead, so
generation matches a full forward and :func:`hf_rope_ext.unpatch_model` gives back the
original model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import re
import shlex
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from . import compat, config_io
from .config_io import RecordedPatch
from .files import give_umask_permissions, staging_dir
from .methods import get_method, resolve_params
from .patching import (
    _check_length,
    _check_scale,
    _check_steps,
    find_rotary_module,
    get_patch_info,
    patch_model,
    whole_token_scale,
)

logger = logging.getLogger(__name__)

__all__ = [
    "RuntimeCommand",
    "RuntimeSettings",
    "describe_patch",
    "load_patched",
    "push_patched_to_hub",
    "restore_patch",
    "runtime_settings",
    "save_patched",
]

# Weight files a previous save may have left in the target folder (shard counts change).
_WEIGHT_FILES = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?$")


# ----------------------------------------------------------------------------------------------
# Saving and pushing
# ----------------------------------------------------------------------------------------------


def _recorded_patch(model: nn.Module) -> RecordedPatch:
    config = getattr(model, "config", None)
    recorded = config_io.verify_record(config) if config is not None else None
    if recorded is None:
        raise ValueError(
            f"{type(model).__name__} is not patched by hf_rope_ext (its config has no `{config_io.RECORD_ATTRIBUTE}` "
            "record). Call hf_rope_ext.patch_model(model, scale=..., method=...) first, or use save_pretrained for an "
            "unpatched model."
        )
    return recorded


def _legacy_fields(rope: dict[str, Any]) -> dict[str, Any]:
    """``rope_scaling`` / ``rope_theta`` as transformers 4.x (and runtimes built on it) read them."""
    scaling = {key: value for key, value in rope.items() if key != "rope_theta"}
    fields = {
        "rope_theta": rope["rope_theta"],
        "rope_scaling": None if scaling.get("rope_type") == "default" else scaling,
    }
    if scaling.get("rope_type") == "longrope":
        # transformers 4.x takes longrope's original context from this top-level key (the Phi-3
        # layout) and otherwise from max_position_embeddings; transformers 5 gives it priority.
        fields["original_max_position_embeddings"] = scaling["original_max_position_embeddings"]
    return fields


def save_patched(
    model: nn.Module,
    save_directory: str | os.PathLike,
    *,
    tokenizer: Any = None,
    card: Any = None,
    card_assets: Any = (),
    legacy_fields: bool = True,
    **save_kwargs: Any,
) -> Path:
    """Save a patched model so that transformers, vLLM and llama.cpp read the same RoPE.

    Args:
        model: a model patched with :func:`hf_rope_ext.patch_model` (or loaded from such a
            checkpoint). A peft model must be merged first (``merge_and_unload()``).
        save_directory: target folder; created if needed. Files other than the ones written
            here are left alone; old weight shards are removed.
        tokenizer: saved alongside; a finite ``model_max_length`` below the extended context
            is raised to it in the saved copy (vLLM caps its maximum length by it).
        card: a ``huggingface_hub.ModelCard`` or markdown string written as ``README.md``
            (see :mod:`hf_rope_ext.model_card`).
        card_assets: files the card references (plots), copied next to it.
        legacy_fields: also write ``rope_scaling`` and top-level ``rope_theta`` (the
            transformers 4.x spelling, still read by runtimes built on it; checked to load to
            the same logits with transformers 4.57). transformers 5 reads both spellings to the
            same ``rope_parameters``, giving ``rope_scaling`` priority: edit both or neither.
        **save_kwargs: passed to ``model.save_pretrained`` (e.g. ``max_shard_size``).

    Everything is written to a temporary folder next to the target and checked (the saved
    config is read back and verified) before the files are moved in, so a failure half way
    leaves the target as it was. Returns the target folder.
    """
    if hasattr(model, "peft_config"):
        raise ValueError(
            "This is a peft model: saving it would store the adapter only. Merge it first "
            "(model = model.merge_and_unload()) and save the merged model."
        )
    recorded = _recorded_patch(model)
    if recorded.method.name == "dynamic" and recorded.steps_per_doubling is not None:
        logger.warning(
            "The patch changes frequencies at %d steps per doubling of the length; transformers' own `dynamic` type, "
            "which plain from_pretrained builds, follows the length token by token. Use hf_rope_ext.hub.load_patched "
            "to get this patch back exactly.",
            recorded.steps_per_doubling,
        )
    target = Path(save_directory)
    if target.exists() and not target.is_dir():
        raise ValueError(f"{target} is a file; save_patched needs a folder (new or existing).")
    # Folders created here are removed again if the save fails: the target is left as it was.
    created = [folder for folder in (target.parent, *target.parent.parents) if not folder.exists()]
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(target.parent, f".{target.name}.saving-")
    try:
        model.save_pretrained(staging, **save_kwargs)
        if tokenizer is not None:
            _save_tokenizer(tokenizer, staging, recorded.extended_context)
        config_path = staging / "config.json"
        if legacy_fields:
            saved = json.loads(config_path.read_text())
            saved.update(_legacy_fields(saved["rope_parameters"]))
            config_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
        _check_saved_config(staging, model.config)
        if card is not None:
            (staging / "README.md").write_text(str(card))
        for asset in map(Path, card_assets):
            shutil.copyfile(asset, staging / asset.name)
        give_umask_permissions(staging)
        if not target.exists():
            os.replace(staging, target)  # a new folder appears whole
        else:
            written = {path.name for path in staging.iterdir()}
            for stale in target.iterdir():
                if _WEIGHT_FILES.match(stale.name) and stale.name not in written:
                    stale.unlink()
            for path in staging.iterdir():
                os.replace(path, target / path.name)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for folder in created:  # deepest first
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info(
        "Saved %s (%s, scale %g, context %d -> %d) to %s.",
        type(model).__name__,
        recorded.method.name,
        recorded.scale,
        recorded.original_max_position_embeddings,
        recorded.extended_context,
        target,
    )
    return target


def _save_tokenizer(tokenizer: Any, folder: Path, extended: int) -> None:
    previous = getattr(tokenizer, "model_max_length", None)
    raise_limit = isinstance(previous, int) and previous < extended
    if raise_limit:
        tokenizer.model_max_length = extended
    try:
        tokenizer.save_pretrained(folder)
    finally:
        if raise_limit:
            tokenizer.model_max_length = previous


def _check_saved_config(folder: Path, live_config: Any) -> None:
    saved = read_checked_config(folder)
    config_io.verify_record(saved)
    if saved.rope_parameters != live_config.rope_parameters or (
        saved.max_position_embeddings != live_config.max_position_embeddings
    ):
        raise RuntimeError(
            f"The saved config.json reads back as rope_parameters={saved.rope_parameters}, max_position_embeddings="
            f"{saved.max_position_embeddings}, not as the model's {live_config.rope_parameters}, "
            f"{live_config.max_position_embeddings}; nothing was written to the target folder."
        )


def push_patched_to_hub(
    model: nn.Module,
    repo_id: str,
    *,
    tokenizer: Any = None,
    card: Any = None,
    card_assets: Any = (),
    private: bool | None = None,
    token: str | bool | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    create_pr: bool = False,
    api: Any = None,
    **save_kwargs: Any,
):
    """:func:`save_patched` into a temporary folder, then upload it as one commit.

    ``api`` defaults to ``huggingface_hub.HfApi()``; the repository is created if missing.
    Returns the ``CommitInfo`` of the upload.
    """
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()
    recorded = _recorded_patch(model)
    message = commit_message or (
        f"Upload {recorded.method.name} x{recorded.scale:g} patched model "
        f"({recorded.original_max_position_embeddings} -> {recorded.extended_context} tokens) with hf-rope-ext"
    )
    with tempfile.TemporaryDirectory(prefix="hf_rope_ext-push-") as folder:
        save_patched(model, folder, tokenizer=tokenizer, card=card, card_assets=card_assets, **save_kwargs)
        api.create_repo(repo_id, token=token, private=private, exist_ok=True)
        return api.upload_folder(
            repo_id=repo_id,
            folder_path=folder,
            commit_message=message,
            token=token,
            revision=revision,
            create_pr=create_pr,
        )


# ----------------------------------------------------------------------------------------------
# Loading back into the patch
# ----------------------------------------------------------------------------------------------


def restore_patch(model: nn.Module) -> nn.Module:
    """Turn a model loaded from a patched checkpoint back into this package's patch, in place.

    ``from_pretrained`` built transformers' rotary module from the scaled config. This puts
    the original RoPE settings back into the config, replaces that module instance by a fresh
    one of the same class built from them, and applies :func:`hf_rope_ext.patch_model` with
    the recorded method, scale and parameters. Afterwards the model behaves exactly like the
    one that was saved (KV cache handling included) and :func:`hf_rope_ext.unpatch_model`
    returns the original model. On any error the model is left as it was.
    """
    if get_patch_info(model) is not None:
        raise ValueError(f"{type(model).__name__} is already patched by hf_rope_ext; nothing to restore.")
    module_name, loaded = find_rotary_module(model)
    config = getattr(loaded, "config", None) or getattr(model, "config", None)
    recorded = config_io.verify_record(config)
    if recorded is None:
        raise ValueError(
            f"The config of this {getattr(config, 'model_type', '?')!r} model has no `{config_io.RECORD_ATTRIBUTE}` "
            "record: it was not saved from a model patched by hf_rope_ext, so there is no patch to restore. "
            "Use hf_rope_ext.patch_model to patch it."
        )
    parent_name, _, attribute = module_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    saved = compat.snapshot_config(config, (config_io.RECORD_ATTRIBUTE, "original_max_position_embeddings"))
    try:
        rope, max_positions = recorded.original_rope_config()
        compat.write_rope_config(config, rope, max_positions)
        delattr(config, config_io.RECORD_ATTRIBUTE)  # the patch writes a new one; unpatch removes it
        if recorded.method.name == "longrope" and getattr(config, "original_max_position_embeddings", None) == (
            recorded.original_max_position_embeddings
        ):
            delattr(config, "original_max_position_embeddings")  # written by save_patched for transformers 4.x
        try:
            fresh = type(loaded)(config=config)
        except TypeError as error:
            raise ValueError(
                f"Cannot rebuild {type(loaded).__name__} from the original config ({error}); restore_patch supports "
                "rotary modules built as Module(config=config), as in Llama, Mistral, Qwen2 and Qwen3."
            ) from error
        fresh.to(loaded.inv_freq.device)
        setattr(parent, attribute, fresh)
        if recorded.method.length_dependent:
            options = {"steps_per_doubling": recorded.steps_per_doubling}
        else:
            options = {}
        patch_model(
            model,
            recorded.scale,
            recorded.method.name,
            original_max_length=recorded.original_max_position_embeddings,
            logn_attention=recorded.logn_attention,
            **options,
            **recorded.params,
        )
    except Exception:
        setattr(parent, attribute, loaded)
        compat.restore_config(config, saved)
        raise
    logger.info("Restored the %s patch (scale %g) on %s.", recorded.method.name, recorded.scale, module_name)
    return model


_CONFIG_KWARGS = ("cache_dir", "force_download", "local_files_only", "proxies", "revision", "subfolder", "token")


def read_checked_config(name_or_path: str | os.PathLike, **config_kwargs: Any):
    """``AutoConfig.from_pretrained``, after checking that config.json's ``rope_parameters`` and
    legacy ``rope_scaling`` agree (:func:`hf_rope_ext.config_io.check_rope_spellings`)."""
    from transformers import AutoConfig, PretrainedConfig

    from .loading import is_missing_folder

    if is_missing_folder(name_or_path):
        raise FileNotFoundError(f"Checkpoint folder not found: {name_or_path}.")
    folder = Path(name_or_path) / config_kwargs.get("subfolder", "")
    if Path(name_or_path).is_dir() and not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"{name_or_path} has no config.json, so it is not a checkpoint folder (one written by save_patched or "
            "save_pretrained)."
        )
    raw, _ = PretrainedConfig.get_config_dict(name_or_path, **config_kwargs)
    config_io.check_rope_spellings(raw, str(name_or_path))
    return AutoConfig.from_pretrained(name_or_path, **config_kwargs)


def load_patched(name_or_path: str | os.PathLike, *, restore: bool = True, **from_pretrained_kwargs: Any) -> nn.Module:
    """Load a causal LM saved from a patched model, by folder or Hub repo id.

    The config is read and its ``hf_rope_ext`` record checked before the model is built, so
    an edited or corrupt config.json is refused with an error naming the contradiction.
    With ``restore=True`` (default) the patch is rebuilt with :func:`restore_patch`;
    ``restore=False`` returns what ``from_pretrained`` built. A checkpoint without a record
    loads as plain transformers loads it. Other keyword arguments go to ``from_pretrained``.
    """
    from transformers import AutoModelForCausalLM

    config = from_pretrained_kwargs.pop("config", None)
    if config is None:
        config_kwargs = {key: from_pretrained_kwargs[key] for key in _CONFIG_KWARGS if key in from_pretrained_kwargs}
        config = read_checked_config(name_or_path, **config_kwargs)
    recorded = config_io.verify_record(config)
    model = AutoModelForCausalLM.from_pretrained(name_or_path, config=config, **from_pretrained_kwargs)
    if recorded is None:
        logger.info("%s has no hf_rope_ext record; loaded as transformers reads it.", name_or_path)
    elif restore:
        restore_patch(model)
    return model


# ----------------------------------------------------------------------------------------------
# vLLM and llama.cpp
# ----------------------------------------------------------------------------------------------

_DEFAULT_STEPS = object()  # describe_patch: the patch's default steps_per_doubling

# transformers model_type -> llama.cpp GGUF architecture name (convert_hf_to_gguf.py converts
# Mistral checkpoints with its Llama class).
_GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


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


def describe_patch(
    method: str,
    scale: float,
    *,
    original_max_length: int,
    rope_theta: float,
    rotary_dim: int,
    steps_per_doubling: Any = _DEFAULT_STEPS,
    partial_rotary_factor: float | None = None,
    **params: Any,
) -> RecordedPatch:
    """A patch described by its numbers alone (no model), for :func:`runtime_settings`.

    Arguments mean what they mean for :func:`hf_rope_ext.patch_model`; ``rope_theta`` and
    ``rotary_dim`` are the base model's RoPE base and rotated dimensions per head.
    """
    from .patching import DEFAULT_STEPS_PER_DOUBLING

    rope_method = get_method(method)
    original = _check_length(original_max_length, "original_max_length")
    scale = whole_token_scale(_check_scale(scale), original)
    rotary_dim = _check_length(rotary_dim, "rotary_dim", "number of dimensions")
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even (pairs of dimensions rotate together), got {rotary_dim}.")
    if isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float)) or not rope_theta > 0:
        raise ValueError(f"rope_theta must be a number > 0, got {rope_theta!r}.")
    resolved = resolve_params(rope_method, rotary_dim, params)
    if not rope_method.length_dependent:
        if steps_per_doubling is not _DEFAULT_STEPS:
            raise ValueError(f"steps_per_doubling only applies to length-dependent methods; {method!r} is static.")
        steps = None
    elif steps_per_doubling is _DEFAULT_STEPS:
        steps = DEFAULT_STEPS_PER_DOUBLING
    else:
        steps = _check_steps(steps_per_doubling)
    kept = {"partial_rotary_factor": partial_rotary_factor} if partial_rotary_factor is not None else {}
    return RecordedPatch(rope_method, scale, original, float(rope_theta), rotary_dim, resolved, steps, kept)


def _patch_of(
    source: Any, method: str | None, scale: float | None, patch_kwargs: dict[str, Any]
) -> tuple[RecordedPatch, str | None]:
    if isinstance(source, RecordedPatch):
        if method is not None or scale is not None or patch_kwargs:
            raise ValueError("Give method/scale/parameters or a described patch, not both.")
        return source, None
    config = getattr(source, "config", source) if isinstance(source, nn.Module) else source
    if not hasattr(config, "rope_parameters"):
        raise TypeError(
            "runtime_settings expects a model, a transformers config or describe_patch(...), got "
            f"{type(source).__name__}."
        )
    model_type = getattr(config, "model_type", None)
    if method is None:
        if scale is not None or patch_kwargs:
            raise ValueError("scale and method parameters need method= as well.")
        recorded = config_io.verify_record(config)
        if recorded is None:
            raise ValueError(
                f"This {model_type!r} config has no hf_rope_ext record; give method= and scale= to describe a patch "
                "of this (unpatched) model."
            )
        return recorded, model_type
    if config_io.read_record(config) is not None:
        raise ValueError("This config is already patched; describe a new patch on the original model's config.")
    rope = compat.rope_parameters(config)
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"This config already uses RoPE scaling (rope_type={rope['rope_type']!r}).")
    if scale is None:
        raise ValueError("runtime_settings needs scale= together with method=.")
    original = patch_kwargs.pop("original_max_length", None) or config.max_position_embeddings
    kept = {key: rope[key] for key in ("partial_rotary_factor",) if key in rope}
    return (
        describe_patch(
            method,
            scale,
            original_max_length=original,
            rope_theta=rope["rope_theta"],
            rotary_dim=config_io.rotary_dim_of(config, rope),
            partial_rotary_factor=kept.get("partial_rotary_factor"),
            **patch_kwargs,
        ),
        model_type,
    )


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
    patch, found_type = _patch_of(source, method, scale, dict(patch_kwargs))
    if patch.method.attention is not None:
        vllm, llama_cpp = _attention_level_commands(patch, model_type or found_type)
    else:
        vllm, llama_cpp = _vllm_command(patch), _llama_cpp_command(patch, model_type or found_type)
    if patch.logn_attention:
        vllm, llama_cpp = _without_logn(vllm), _without_logn(llama_cpp)
    return RuntimeSettings(
        method=patch.method.name + ("+logn" if patch.logn_attention else ""),
        scale=patch.scale,
        original_context=patch.original_max_position_embeddings,
        extended_context=patch.extended_context,
        vllm=vllm,
        llama_cpp=llama_cpp,
    )


def _without_logn(command: RuntimeCommand) -> RuntimeCommand:
    """Log-n attention has no setting in either runtime: the rest of the patch is what they run."""
    note = (
        "log-n attention (logits x max(1, ln(i + 1) / ln(L0)) beyond the original context) has no setting here; "
        "these settings run the patch without it."
    )
    status = "approximate" if command.status == "exact" else command.status
    return RuntimeCommand(command.runtime, status, command.args, command.settings, (*command.notes, note))


def _attention_level_commands(patch: RecordedPatch, model_type: str | None) -> tuple[RuntimeCommand, RuntimeCommand]:
    """Attention-level methods remap positions inside attention, which neither runtime's RoPE settings express."""
    name = patch.method.name
    vllm_notes = [
        f"vLLM has no {name} attention for this architecture (its dual-chunk attention backend is tied to Qwen2 "
        "models with dual_chunk_attention_config); serve the base model within its original context, or use a "
        "frequency method (yarn)."
    ]
    llama_notes = [f"llama.cpp has no {name} attention setting for converted checkpoints."]
    args: tuple[str, ...] = ()
    status = "unsupported"
    if name == "self-extend":
        remap = patch.method.attention(patch.resolved_params())
        # llama.cpp's grouped attention: the same idea (group factor n, neighbour width w), applied by
        # shifting cached positions block by block; w must be a multiple of n there.
        width = max(remap.group_size, (remap.neighbor_window // remap.group_size) * remap.group_size)
        args = ("--grp-attn-n", str(remap.group_size), "--grp-attn-w", str(width), "--ctx-size", str(patch.extended_context))
        status = "approximate"
        llama_notes = [
            "llama-cli's grouped attention (Self-Extend) takes a group factor and a width that must be a multiple of "
            f"it ({width} here, the patch uses a neighbour window of {remap.neighbor_window}); it regroups cached "
            "positions block by block during generation instead of per query, so outputs differ in detail."
        ]
    return (
        RuntimeCommand("vllm", "unsupported", notes=tuple(vllm_notes)),
        RuntimeCommand("llama.cpp", status, args, {}, tuple(llama_notes)),
    )


def _flag_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        return str(value)
    value = float(value)
    return str(int(value)) if value.is_integer() else repr(value)


def _yarn_mscale(scale: float) -> float:
    # YaRN's default attention factor 0.1 ln(s) + 1, applied by vLLM and llama.cpp on top of
    # their own attn_factor.
    return 0.1 * math.log(scale) + 1.0


def _full_length_ntk_base(patch: RecordedPatch) -> float:
    # Dynamic NTK at length L = s * L0: b * (s * L / L0 - (s - 1)) ** (d / (d - 2)).
    s, d = patch.scale, patch.rotary_dim
    return patch.original_rope_theta * (s * s - (s - 1)) ** (d / (d - 2))


def _static_stand_in(patch: RecordedPatch) -> tuple[str, str | None]:
    """The static method a runtime can run instead, and why it differs (None when exact)."""
    name, s = patch.method.name, patch.scale
    n = patch.extended_context
    if name == "dynamic-yarn":
        return "yarn", (
            f"No runtime has dynamic YaRN. Closest: static yarn at scale {s:g}, which equals this patch for inputs of "
            f"{n} tokens; shorter inputs get more interpolation than the patch gives them (the patch is the original "
            f"model up to {patch.original_max_position_embeddings} tokens)."
        )
    if name == "dynamic-linear":
        return "linear", (
            "No runtime has length-dependent linear interpolation. "
            f"Closest: linear at scale {s:g}, equal to this patch for inputs of {n} tokens; the patch is the "
            f"original model up to {patch.original_max_position_embeddings} tokens, static linear compresses every "
            "input."
        )
    return name, None


def _vllm_command(patch: RecordedPatch) -> RuntimeCommand:
    name = patch.method.name
    if patch.method.transformers_rope_type is None and name not in ("dynamic-yarn", "dynamic-linear"):
        return RuntimeCommand(
            "vllm",
            "unsupported",
            notes=(
                f"vLLM cannot run the user-registered method {name!r}: it builds only its own rope types "
                "(get_rope in vllm/model_executor/layers/rotary_embedding/__init__.py raises "
                "'Unknown RoPE scaling type').",
            ),
        )
    target, difference = _static_stand_in(patch)
    notes = [difference] if difference else []
    status = "approximate" if difference else "exact"
    params = dict(patch.resolved_params())
    rope, max_positions = config_io.rope_config_for(
        get_method(target), params, patch.original_rope_theta, patch.rotary_dim, patch.kept
    )
    if target == "dynamic":
        # Pin the full-length frequencies as plain RoPE: vLLM's own `dynamic` is static and its
        # formula changed between releases (vllm-project/vllm issue 41236, PR 41277).
        full_base = _full_length_ntk_base(patch)
        rope, max_positions = {"rope_type": "default", "rope_theta": full_base, **patch.kept}, patch.extended_context
        status = "approximate"
        notes.append(
            "vLLM has no length-dependent NTK scaling: its `dynamic` computes one base for all requests, and that base "
            "changed between releases (before vllm-project/vllm PR 41277 it was the base of the full length). These "
            f"overrides pin that: plain RoPE with the NTK base dynamic scaling reaches at {patch.extended_context} "
            f"tokens, {full_base:.6g}, for every request; the patch keeps the original RoPE up to "
            f"{patch.original_max_position_embeddings} tokens and scales with the current length beyond."
        )
    if target == "yarn":
        if params.get("attention_factor") is not None:
            # vLLM multiplies its own 0.1 ln(s) + 1 by `attn_factor`; get_rope passes no attention_factor.
            rope["attn_factor"] = float(params["attention_factor"]) / _yarn_mscale(patch.scale)
            status = "approximate"
            notes.append(
                f"attention_factor={params['attention_factor']} is written as attn_factor={rope['attn_factor']:.6g} "
                "(vLLM applies attn_factor x (0.1 ln s + 1)); check that your vLLM release accepts attn_factor."
            )
        if not params.get("truncate", True):
            status = "approximate"
            notes.append(
                "truncate=false is honoured only by vLLM releases whose YaRN takes `truncate`; older ones round."
            )
    if target == "longrope":
        _, attention = patch.method.compute(patch.rotary_dim, patch.original_rope_theta, params, None)
        # vLLM derives the attention factor from max_position_embeddings / original instead of `factor`.
        rope["short_mscale"] = rope["long_mscale"] = float(attention)
        if rope["short_factor"] != rope["long_factor"]:
            status = "approximate"
            notes.append(
                "vLLM uses long_factor for every request once --max-model-len exceeds "
                f"{patch.original_max_position_embeddings} (Phi3LongRoPEScaledRotaryEmbedding); the patch uses "
                f"short_factor for inputs up to {patch.original_max_position_embeddings} tokens. Outputs agree for "
                "longer inputs."
            )
    overrides = {"rope_parameters": rope, "max_position_embeddings": max_positions}
    if target == "linear":
        notes.append(
            "vLLM derives the maximum length of `linear` as max_position_embeddings x factor; --max-model-len sets "
            "the real one."
        )
    if patch.method.transformers_rope_type is None:
        notes.append(
            f"vLLM cannot load a checkpoint with rope_type {config_io.custom_rope_type(patch.method)!r}; serve the "
            "base model with these overrides."
        )
    elif target == "dynamic":
        notes.append("Serving a saved `dynamic` checkpoint directly uses vLLM's own `dynamic`; use these overrides.")
    else:
        notes.append(
            "A checkpoint saved with hf_rope_ext already holds these settings: `vllm serve CHECKPOINT "
            f"--max-model-len {patch.extended_context}` is enough; --hf-overrides applies them to the base model."
        )
    notes.append(
        "vLLM releases built on transformers 4.x read `rope_scaling` and `rope_theta` instead of `rope_parameters`; "
        "`hf-rope-ext runtimes --json` prints those overrides as legacy_hf_overrides."
    )
    legacy = {**_legacy_fields(rope), "max_position_embeddings": max_positions}
    args = (
        "--max-model-len",
        str(patch.extended_context),
        "--hf-overrides",
        json.dumps(overrides, separators=(",", ":")),
    )
    settings = {
        "max_model_len": patch.extended_context,
        "hf_overrides": overrides,
        "legacy_hf_overrides": legacy,
    }
    return RuntimeCommand("vllm", status, args, settings, tuple(notes))


def _llama_cpp_command(patch: RecordedPatch, model_type: str | None) -> RuntimeCommand:
    name = patch.method.name
    arch = _GGUF_ARCH.get(model_type or "", model_type or "llama")
    notes: list[str] = []
    if model_type not in _GGUF_ARCH:
        notes.append(f"GGUF keys assume the architecture name {arch!r}; check general.architecture in your file.")
    target, difference = _static_stand_in(patch)
    status = "exact"
    if difference:
        status = "approximate"
        notes.append(difference)
    n = patch.extended_context
    base = patch.original_rope_theta
    params = patch.resolved_params()
    flags: dict[str, Any]
    metadata: dict[str, Any] = {f"{arch}.context_length": n}

    if patch.method.transformers_rope_type is None and difference is None:
        return RuntimeCommand(
            "llama.cpp",
            "unsupported",
            notes=(
                f"llama.cpp cannot run the user-registered method {name!r}. Its converter (convert_hf_to_gguf.py) "
                "logs 'Unknown RoPE type' for such a checkpoint and writes plain RoPE.",
            ),
        )
    if target == "ntk":
        scaled = base * patch.scale ** (patch.rotary_dim / (patch.rotary_dim - 2))
        flags = {"--rope-scaling": "none", "--rope-freq-base": scaled}
        metadata[f"{arch}.rope.freq_base"] = scaled
    elif target == "linear":
        flags = {"--rope-scaling": "linear", "--rope-scale": patch.scale, "--rope-freq-base": base}
        metadata.update({
            f"{arch}.rope.freq_base": base,
            f"{arch}.rope.scaling.type": "linear",
            f"{arch}.rope.scaling.factor": patch.scale,
        })
    elif target == "yarn":
        attn_factor = 1.0
        if params.get("attention_factor") is not None:
            attn_factor = float(params["attention_factor"]) / _yarn_mscale(patch.scale)
            notes.append(
                f"attention_factor={params['attention_factor']} becomes yarn attn_factor {attn_factor:.6g}: llama.cpp "
                "multiplies it by 0.1 ln(s) + 1. Releases after ggml-org/llama.cpp PR 17945 override "
                f"--yarn-attn-factor in YaRN mode and read the GGUF key {arch}.rope.scaling.attn_factor instead."
            )
            metadata[f"{arch}.rope.scaling.attn_factor"] = attn_factor
        if not params.get("truncate", True):
            status = "approximate"
            notes.append(
                "llama.cpp always rounds the YaRN ramp ends (ggml_rope_yarn_corr_dims); truncate=false differs."
            )
        flags = {
            "--rope-scaling": "yarn",
            "--rope-scale": patch.scale,
            "--rope-freq-base": base,
            "--yarn-orig-ctx": patch.original_max_position_embeddings,
            "--yarn-ext-factor": 1.0,
            "--yarn-attn-factor": attn_factor,
            "--yarn-beta-fast": params["beta_fast"],
            "--yarn-beta-slow": params["beta_slow"],
        }
        metadata.update({
            f"{arch}.rope.freq_base": base,
            f"{arch}.rope.scaling.type": "yarn",
            f"{arch}.rope.scaling.factor": patch.scale,
            f"{arch}.rope.scaling.original_context_length": patch.original_max_position_embeddings,
            f"{arch}.rope.scaling.yarn_beta_fast": params["beta_fast"],
            f"{arch}.rope.scaling.yarn_beta_slow": params["beta_slow"],
        })
    elif target == "dynamic":
        status = "approximate"
        stand_in = _full_length_ntk_base(patch)
        flags = {"--rope-scaling": "none", "--rope-freq-base": stand_in}
        metadata[f"{arch}.rope.freq_base"] = stand_in
        notes.append(
            "llama.cpp has no dynamic NTK, and convert_hf_to_gguf.py ignores rope_type `dynamic` (a converted file "
            f"runs plain RoPE). Closest: the NTK base dynamic scaling reaches at {n} tokens, "
            f"{stand_in:.6g}, for every input (what vLLM does); the patch is the original model up to "
            f"{patch.original_max_position_embeddings} tokens."
        )
    elif target == "llama3":
        if arch != "llama":
            return RuntimeCommand(
                "llama.cpp",
                "unsupported",
                notes=(
                    f"llama.cpp computes llama3 frequency factors only when converting Llama-architecture models; "
                    f"a {model_type!r} checkpoint converts with plain RoPE.",
                ),
            )
        flags = {}
        metadata[f"{arch}.rope.freq_base"] = base
        notes.append(
            "No command-line flags express llama3 scaling: convert this checkpoint with convert_hf_to_gguf.py, which "
            "stores the per-frequency factors in a rope_freqs tensor; then only --ctx-size is needed."
        )
    else:  # longrope
        return RuntimeCommand(
            "llama.cpp",
            "unsupported",
            notes=(
                "llama.cpp reads LongRoPE factors only for Phi-3 models (rope_factors_long/short tensors); "
                f"{model_type or 'this'!r} checkpoints convert without them.",
            ),
        )
    flags["--ctx-size"] = n
    args = tuple(part for flag, value in flags.items() for part in (flag, _flag_text(value)))
    if patch.method.transformers_rope_type is None:
        notes.append(
            "convert_hf_to_gguf.py does not know this checkpoint's rope_type and writes plain RoPE: convert the base "
            "model and pass the flags above."
        )
    settings = {"flags": flags, "gguf_metadata": metadata}
    return RuntimeCommand("llama.cpp", status, args, settings, tuple(notes))


# ----------------------------------------------------------------------------------------------
# Command line: hf-rope-ext runtimes
# ----------------------------------------------------------------------------------------------


def _parse_param(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--param takes KEY=VALUE (e.g. beta_fast=32), got {text!r}.")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "runtimes",
        help="print the vLLM and llama.cpp settings equivalent to a patch",
        description=(
            "Print vLLM (--hf-overrides, --max-model-len) and llama.cpp (--rope-scaling ... flags, GGUF keys) settings "
            "for a patched checkpoint (--model-dir), for a patch of a base model (--model-dir plus --method/--scale), "
            "or for a patch given by numbers (--method, --scale, --original-context, --rope-theta, --rotary-dim)."
        ),
    )
    parser.add_argument("--model-dir", help="checkpoint folder or Hub id (its config.json is read)")
    parser.add_argument("--method", help="RoPE method (hf-rope-ext methods lists them)")
    parser.add_argument("--scale", type=float, help="context multiplier (> 1)")
    parser.add_argument("--original-context", type=int, help="context the model was trained on")
    parser.add_argument("--rope-theta", type=float, help="RoPE base of the model (without --model-dir)")
    parser.add_argument("--rotary-dim", type=int, help="rotated dimensions per head (without --model-dir)")
    parser.add_argument("--model-type", help="transformers model_type, for GGUF key names (default: from the config)")
    parser.add_argument("--steps-per-doubling", type=int, help="length-dependent methods: frequency steps per doubling")
    parser.add_argument("--param", action="append", type=_parse_param, default=[], metavar="KEY=VALUE",
                        help="a method parameter, e.g. --param beta_fast=32 (repeatable)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.set_defaults(handler=_runtimes_command)


def _runtimes_command(args: argparse.Namespace) -> int:
    try:
        return _runtimes(args)
    except TypeError as error:  # a parameter of the wrong type (--param beta_fast=abc): bad input too
        raise ValueError(str(error)) from None


def _runtimes(args: argparse.Namespace) -> int:
    params = dict(args.param)
    if args.steps_per_doubling is not None:
        params["steps_per_doubling"] = args.steps_per_doubling
    if args.model_dir:
        if args.rope_theta is not None or args.rotary_dim is not None:
            raise SystemExit("--rope-theta/--rotary-dim describe a model without --model-dir; give one or the other.")
        config = read_checked_config(args.model_dir)
        if args.original_context is not None:
            params["original_max_length"] = args.original_context
        settings = runtime_settings(config, args.method, args.scale, model_type=args.model_type, **params)
        # Runtimes cannot load a checkpoint with one of this package's own rope types.
        model = args.model_dir if args.method or get_method(settings.method).transformers_rope_type else "BASE_MODEL"
    else:
        missing = [flag for flag, value in (("--method", args.method), ("--scale", args.scale),
                   ("--original-context", args.original_context), ("--rope-theta", args.rope_theta),
                   ("--rotary-dim", args.rotary_dim)) if value is None]
        if missing:
            raise SystemExit(f"Without --model-dir, give {', '.join(missing)}.")
        patch = describe_patch(args.method, args.scale, original_max_length=args.original_context,
                               rope_theta=args.rope_theta, rotary_dim=args.rotary_dim, **params)
        settings = runtime_settings(patch, model_type=args.model_type)
        model = "MODEL"
    print(json.dumps(settings.to_dict(), indent=2) if args.json else settings.format(model=model))
    return 0
