"""Patched checkpoints: save, push to the Hub, load back.

    from hf_rope_ext import patch_model
    from hf_rope_ext.hub import save_patched, load_patched
    from hf_rope_ext.runtimes import runtime_settings

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

The vLLM and llama.cpp settings of a patch are in :mod:`hf_rope_ext.runtimes` (``runtime_settings``,
``describe_patch``, ``RuntimeCommand`` and ``RuntimeSettings`` stay importable from here).
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import inspect
import json
import logging
import math
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

from torch import nn

from . import compat, config_io
from .attention import implementation_behind
from .files import atomic_directory, restore_interrupted_save
from .patching import find_rotary_module, get_patch_info, no_call_under_way, owner_and_attribute
from .runtimes import RuntimeCommand, RuntimeSettings, describe_patch, runtime_settings  # noqa: F401  (moved there)
from .spec import PatchSpec
from .validation import is_finite

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

# Weight files a previous save may have left in the target folder (shard counts change), in
# any format transformers or peft would load from it: an adapter left beside full weights is
# attached again by from_pretrained, and pickled weights are read when safetensors are absent.
# A ``variant=`` save names them ``model.<variant>.safetensors``, ``model.<variant>-00001-of-00002
# .safetensors`` and ``model.safetensors.index.<variant>.json`` (transformers' _add_variant): an old
# variant left beside the new weights would load with the new config under that variant.
_WEIGHT_FILES = re.compile(
    r"^(model(\.[^/]+)?(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index(\.[^/]+)?\.json"
    r"|pytorch_model(\.[^/]+)?(-\d{5}-of-\d{5})?\.bin|pytorch_model\.bin\.index(\.[^/]+)?\.json"
    r"|adapter_config\.json|adapter_model\.(safetensors|bin))$"
)
# The same files as patterns for the Hub (fnmatch): a push deletes those an earlier push left,
# since upload_folder only adds and overwrites, and transformers reads model.safetensors before
# a shard index (an old single file would load in place of new shards).
_WEIGHT_PATTERNS = [
    "model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json",
    "model.*.safetensors", "model.safetensors.index.*.json",  # variants (model.*-00001-of-00002.safetensors too)
    "pytorch_model.bin", "pytorch_model-*-of-*.bin", "pytorch_model.bin.index.json",
    "pytorch_model.*.bin", "pytorch_model.bin.index.*.json",
    "adapter_config.json", "adapter_model.safetensors", "adapter_model.bin",
]  # fmt: skip
_CARD = "README.md"
_TOKENIZER_CONFIG = "tokenizer_config.json"
# save_pretrained's arguments for its own push to the Hub: it would upload the staging folder from
# inside save_pretrained, before save_patched completes and checks config.json (and delete no old
# shards); without push_to_hub it ignores the others.
_SAVE_PRETRAINED_PUSH_KWARGS = ("push_to_hub", "repo_id", "commit_message", "create_pr", "private", "token")
# save_patched's own keyword arguments, which push_patched_to_hub passes on through its **save_kwargs.
_SAVE_PATCHED_OWN_KWARGS = ("tokenizer", "card", "card_assets", "legacy_fields")
# The repo ids a card's loading instructions name (model_card.md: load_patched("...") and from_pretrained("...")).
_CARD_LOADED_REPO = re.compile(r'(?:load_patched|from_pretrained)\("([^"\n]+)"\)')


# ----------------------------------------------------------------------------------------------
# Saving and pushing
# ----------------------------------------------------------------------------------------------


def _recorded_patch(model: nn.Module) -> PatchSpec:
    config = getattr(model, "config", None)
    try:
        recorded = config_io.verify_record(config) if config is not None else None
    except ValueError as error:
        if get_patch_info(model) is None:
            raise
        # The live config of a patched model, not a file: it was changed after patch_model.
        raise ValueError(
            f"The config of this patched model was changed after patch_model: its `{config_io.RECORD_ATTRIBUTE}` "
            f"record {getattr(error, 'problem', error)} Nothing was saved; call patch_model again, then save."
        ) from None
    if recorded is None:
        if get_patch_info(model) is not None:  # e.g. only model.model was patched: its own config holds the record
            raise ValueError(
                f"Only a part of this {type(model).__name__} is patched, so its own config has no "
                f"`{config_io.RECORD_ATTRIBUTE}` record. Save the model you passed to patch_model, or patch the whole "
                "model (patch_model(model, ...)) and save it."
            )
        raise ValueError(
            f"{type(model).__name__} is not patched by hf_rope_ext (its config has no `{config_io.RECORD_ATTRIBUTE}` "
            "record). Call hf_rope_ext.patch_model(model, scale=..., method=...) first, or use save_pretrained for an "
            "unpatched model."
        )
    return recorded


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
            here (a README of your own) are kept; old weight shards are removed, and so is a
            model card hf_rope_ext generated for another patch (with a warning).
        tokenizer: saved alongside; a finite ``model_max_length`` below the extended context
            is raised to it in the saved copy (vLLM caps its maximum length by it). Without
            one, a ``tokenizer_config.json`` already in the folder gets the same raise.
        card: written as ``README.md`` (see :mod:`hf_rope_ext.model_card`): a
            ``huggingface_hub.ModelCard``, the card's markdown text (a ``str`` with line breaks),
            or a markdown file's path (an ``os.PathLike`` or a one-line ``str``; one that names
            no file is refused). A card hf_rope_ext rendered for another patch than this
            model's (method, scale, original context, parameters) is refused.
        card_assets: files the card references (plots), copied next to it.
        legacy_fields: also write ``rope_scaling`` and top-level ``rope_theta`` (the
            transformers 4.x spelling, still read by runtimes built on it; checked to load to
            the same logits with transformers 4.57), with YaRN's ``attention_factor`` also as the
            ``attn_factor`` older vLLM releases read. transformers 5 reads both spellings to the
            same ``rope_parameters``, giving ``rope_scaling`` priority: edit both or neither.
        **save_kwargs: passed to ``model.save_pretrained``: the keyword arguments its signature
            names (``max_shard_size``, ``variant``, ...). Others, which it would ignore, are refused.

    Everything is written to a staging folder (beside a new target, inside an existing one) and
    checked (the saved config is read back and verified) before its files replace the target's
    (:func:`hf_rope_ext.files.atomic_directory`), so a failure half way leaves the target as it
    was. Returns the target folder.
    """
    # A patch's generate raises config.max_position_embeddings while it runs (cache_consistency): a save
    # then would keep the extended context, and another thread's forward would read a half-written state.
    with no_call_under_way(model, "save_patched", "a generate call raises config.max_position_embeddings while it "
                           "runs, which the checkpoint would keep"):  # fmt: skip
        return _save_patched(model, save_directory, tokenizer=tokenizer, card=card, card_assets=card_assets,
                             legacy_fields=legacy_fields, **save_kwargs)


def _save_patched(model: nn.Module, save_directory: str | os.PathLike, *, tokenizer: Any, card: Any,
                  card_assets: Any, legacy_fields: bool, **save_kwargs: Any) -> Path:
    _refuse_push_kwargs(save_kwargs)
    if hasattr(model, "peft_config"):
        raise ValueError(
            "This model carries a peft adapter: saving it would store the adapter only. Save the merged model: "
            "merged = peft_model.merge_and_unload() on the peft.PeftModel (not on its get_base_model()); for an "
            "adapter added with model.load_adapter(), load it with peft.PeftModel.from_pretrained(base, adapter_dir) "
            "instead and merge_and_unload() that, or use hf_rope_ext.training.merge_adapter(base_model, adapter_dir)."
        )
    _refuse_unknown_save_kwargs(model, save_kwargs, "save_patched")
    if callable(getattr(model, "get_output_embeddings", None)) and model.get_output_embeddings() is None:
        raise ValueError(
            f"{type(model).__name__} has no language-model head: a checkpoint of it loads as a causal LM with a random "
            "head. Save the model patch_model was given with its head (e.g. LlamaForCausalLM, not its .model)."
        )
    recorded = _recorded_patch(model)
    if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
        raise TypeError(
            f"tokenizer must be a tokenizer object (AutoTokenizer.from_pretrained(...)), got {type(tokenizer).__name__}."
        )
    card_text = _card_text(card)
    if card_text is not None:
        _check_card_patch(card_text, recorded)
    assets = _card_assets(card_assets)
    if recorded.method == "dynamic" and recorded.steps_per_doubling is not None:
        logger.warning(
            "The patch changes frequencies at %d steps per doubling of the length; transformers' own `dynamic` type, "
            "which plain from_pretrained builds, follows the length token by token. Use hf_rope_ext.hub.load_patched "
            "to get this patch back exactly.",
            recorded.steps_per_doubling,
        )
    target = Path(save_directory).expanduser()
    if target.exists() and not target.is_dir():
        raise ValueError(f"{target} is a file; save_patched needs a folder (new or existing).")
    entries = sorted(entry.name for entry in target.iterdir()) if target.is_dir() else []
    stale = [name for name in entries if _WEIGHT_FILES.match(name)]  # to name those removed, after the save
    # A card this package generated describes the patch saved here before: stale if that differs.
    stale_card = card_text is None and _CARD in entries and _card_of_another_patch(target, recorded)
    if stale_card:
        stale.append(_CARD)
    with atomic_directory(target, keep_existing=lambda name: not (_WEIGHT_FILES.match(name) or
                                                                  (stale_card and name == _CARD))) as staging:
        model.save_pretrained(staging, **save_kwargs)
        if tokenizer is not None:
            _save_tokenizer(tokenizer, staging, recorded.extended_context)
        elif _TOKENIZER_CONFIG in entries:
            _raise_kept_tokenizer_limit(target / _TOKENIZER_CONFIG, staging, recorded.extended_context)
        config_path = staging / "config.json"
        saved = json.loads(config_path.read_text())
        # The rotated fraction the module really has (config_io.kept_rope_fields): transformers'
        # scaled rope types read partial_rotary_factor even where the family's module ignores it.
        saved["rope_parameters"].update(recorded.kept)
        if "partial_rotary_factor" in recorded.kept and "partial_rotary_factor" in saved:
            saved["partial_rotary_factor"] = recorded.kept["partial_rotary_factor"]
        if "head_dim" in saved and saved["head_dim"] is None:
            # Mixtral's default: transformers' yarn and longrope read config.head_dim, and fail on null.
            saved["head_dim"] = config_io.head_dim_of(model.config)
        if legacy_fields:
            saved.update(config_io.legacy_fields(saved["rope_parameters"]))
        config_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
        _check_saved_config(staging, model.config, recorded)
        if card_text is not None:
            (staging / "README.md").write_text(card_text)
        for asset in assets:
            if (staging / asset.name).exists():
                raise ValueError(
                    f"card asset {asset} would replace the checkpoint's own {asset.name}; rename the asset. Nothing was "
                    "written to the target folder."
                )
            shutil.copyfile(asset, staging / asset.name)
    replaced = [name for name in stale if not (target / name).exists() and name != _CARD]
    if replaced:
        logger.warning(
            "Removed %s left in %s by an earlier save: they would load in place of, or on top of, these weights.",
            ", ".join(replaced),
            target,
        )
    if stale_card and not (target / _CARD).exists():
        logger.warning(
            "Removed %s from %s: a model card hf_rope_ext generated for the patch saved there before, not for this %s "
            "x%g patch. Write one for it with card=hf_rope_ext.model_card.render_model_card(model, ...)[0].",
            _CARD, target, recorded.label, recorded.scale,
        )  # fmt: skip
    logger.info(
        "Saved %s (%s, scale %g, context %d -> %d) to %s.",
        type(model).__name__,
        recorded.method,
        recorded.scale,
        recorded.original_max_position_embeddings,
        recorded.extended_context,
        target,
    )
    return target


def _refuse_push_kwargs(save_kwargs: dict) -> None:
    given = [key for key in _SAVE_PRETRAINED_PUSH_KWARGS if key in save_kwargs]
    if given:
        raise ValueError(
            f"save_patched saves to a folder and does not take {', '.join(given)} (save_pretrained would push the "
            "unfinished folder itself); to upload, call hf_rope_ext.hub.push_patched_to_hub(model, repo_id, ...), "
            "which takes token=, private=, commit_message= and create_pr=."
        )


def _refuse_unknown_save_kwargs(model: nn.Module, save_kwargs: dict, caller: str) -> None:
    """Refuse a keyword argument that ``model.save_pretrained`` does not name in its signature: its
    ``**kwargs`` are read only for its own push (refused above), so any other key (a misspelt
    ``max_shard_sise``, ``safe_serialization`` that transformers 5 removed) would be dropped silently."""
    save_pretrained = getattr(model, "save_pretrained", None)
    if not callable(save_pretrained) or not save_kwargs:
        return
    parameters = inspect.signature(save_pretrained).parameters.values()
    passed_on = [parameter.name for parameter in parameters if parameter.kind is not parameter.VAR_KEYWORD
                 and parameter.name not in ("save_directory", *_SAVE_PRETRAINED_PUSH_KWARGS)]
    # push_patched_to_hub hands its **save_kwargs to save_patched, which takes its own as well
    accepted = passed_on + list(_SAVE_PATCHED_OWN_KWARGS) if caller == "push_patched_to_hub" else passed_on
    if not save_kwargs.get("is_main_process", True):  # read by truth, as save_pretrained reads it
        # save_pretrained then writes no config.json, which the patch's record lives in
        raise ValueError(
            f"{caller} writes a whole checkpoint and takes no is_main_process={save_kwargs['is_main_process']!r}; "
            "call it on the main process only (if accelerator.is_main_process: ...)."
        )
    for key in save_kwargs:
        if key not in accepted:
            close = difflib.get_close_matches(key, [*passed_on, *_SAVE_PATCHED_OWN_KWARGS], n=1)
            raise TypeError(
                f"{caller} got an unexpected keyword argument {key!r} ({type(model).__name__}.save_pretrained would "
                f"ignore it); {f'did you mean {close[0]}=? ' if close else ''}the keyword arguments passed on to "
                f"save_pretrained are {', '.join(passed_on)}."
            )


def _names_a_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` (``~`` expanded) is a file; text that cannot be a path (too long a name, a
    ``~word`` that is no user) is not one."""
    try:
        return Path(path).expanduser().is_file()
    except (OSError, RuntimeError, ValueError):
        return False


def _card_text(card: Any) -> str | None:
    """The README text of ``card``: a ``huggingface_hub.ModelCard``, a path to a markdown file, or
    the card's markdown text.

    A ``str`` with a line break is the card's text (every card with metadata has several lines);
    a ``str`` on one line is a path, like an ``os.PathLike``, and is refused if it names no file
    (rather than written as a one-line card).
    """
    if isinstance(card, str) and ("\n" in card or "\r" in card):
        line = card.strip()
        # a path read from a file or a command keeps its line break: neither guess, refuse
        if line and "\n" not in line and "\r" not in line and _names_a_file(line):
            raise ValueError(f"card {card!r} is one line and a line break, and names the file {line}; pass "
                             f"Path({line!r}) to use that file, or the card's text.")  # fmt: skip
        return card
    if card is None:
        return card
    if isinstance(card, (str, os.PathLike)):
        if not _names_a_file(card):
            raise FileNotFoundError(
                f"card {str(card)!r} is not a file (a one-line str is read as a path); pass a markdown file's path, a "
                "ModelCard, or the card's markdown text (several lines)."
                if isinstance(card, str) else
                f"card {os.fspath(card)} is not a file; pass a ModelCard, a markdown string or a markdown file path."
            )  # fmt: skip
        path = Path(card).expanduser()
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"card {path} is not UTF-8 text; pass a markdown file.") from None
    if isinstance(card, (bytes, bytearray)) or not hasattr(card, "content"):
        raise TypeError(
            f"card must be a huggingface_hub.ModelCard, a markdown string or a path to one, got {type(card).__name__}."
        )
    return str(card)


def _card_patch(metadata: Any) -> dict | None:
    """The patch an hf_rope_ext card's metadata says it describes (the record less its version, or
    ``{"method", "scale"}`` from versions before that); None for a card of the user's own (no
    ``hf-rope-ext`` tag), ``{}`` for one rendered before cards named it."""
    from .model_card import CARD_PATCH_KEY

    tags = metadata.get("tags") if isinstance(metadata, dict) else None
    if not isinstance(tags, list) or "hf-rope-ext" not in tags:
        return None
    described = metadata.get(CARD_PATCH_KEY)
    return described if isinstance(described, dict) else {}


def _names_whole_patch(described: dict) -> bool:
    """Whether a card's metadata names the whole patch, not only the method and scale older cards name."""
    return "original_max_position_embeddings" in described


def _describes(described: dict, recorded: PatchSpec) -> bool:
    if _names_whole_patch(described):
        return not _card_differences(described, recorded)
    scale = described.get("scale")
    return described.get("method") == recorded.label and is_finite(scale) and math.isclose(scale, recorded.scale)


def _card_differences(described: dict, recorded: PatchSpec) -> list[str]:
    """What a card naming the whole patch says that ``recorded`` does not (``key card vs checkpoint``)."""
    from .model_card import card_patch_metadata

    def flat(record: Any) -> dict:  # params.beta_fast rather than the whole params
        record = dict(record) if isinstance(record, dict) else {}
        params = record.pop("params", None)
        if isinstance(params, dict):
            record.update({f"params.{key}": value for key, value in params.items()})
        elif params is not None:
            record["params"] = params
        return record

    card, saved = flat(described), flat(card_patch_metadata(recorded))
    return [f"{key} {card.get(key, '(none)')!r} vs {saved.get(key, '(none)')!r}"
            for key in sorted(set(card) | set(saved)) if card.get(key) != saved.get(key)]  # fmt: skip


def _scale_text(scale: Any) -> str:
    return f"{scale:g}" if is_finite(scale) else repr(scale)


def _card_metadata(card_text: str) -> Any:
    """The metadata block of a card's text, as metadata_load reads it; None where it has none or
    one that is not YAML (a card of the user's own, in whatever form: not ours to judge)."""
    import yaml
    from huggingface_hub.repocard import REGEX_YAML_BLOCK

    block = REGEX_YAML_BLOCK.search(card_text)
    try:
        return yaml.safe_load(block.group(2)) if block else None
    except yaml.YAMLError:
        return None


def _check_card_patch(card_text: str, recorded: PatchSpec) -> None:
    """Refuse a card hf_rope_ext rendered for another patch than the one being saved."""
    described = _card_patch(_card_metadata(card_text))
    if described == {}:
        logger.warning(
            "The card given is an hf-rope-ext card that does not name its patch (rendered by an older version), so "
            "it was not checked against this %s x%g checkpoint.", recorded.label, recorded.scale,
        )  # fmt: skip
    elif described is not None and _describes(described, recorded) and not _names_whole_patch(described):
        logger.warning(
            "The card given names only the method and scale of its patch (rendered by an older version), so its "
            "context lengths and parameters were not checked against this %s x%g checkpoint.",
            recorded.label, recorded.scale,
        )  # fmt: skip
    elif described is not None and not _describes(described, recorded):
        method = f"{described.get('method')}{'+logn' if described.get('logn_attention') is True else ''}"
        differences = (f" (card vs checkpoint: {'; '.join(_card_differences(described, recorded))})"
                       if _names_whole_patch(described) else "")  # fmt: skip
        raise ValueError(
            f"card= was rendered for a {method} x{_scale_text(described.get('scale'))} patch, not this "
            f"{recorded.label} x{recorded.scale:g} checkpoint{differences}; pass "
            "card=hf_rope_ext.model_card.render_model_card(model, ...)[0] for this model. Nothing was written."
        )


def _card_for_repo(card: Any, repo_id: str) -> Any:
    """``card`` for a push to ``repo_id``: an hf_rope_ext card whose loading instructions name
    another repository is refused, and one rendered without ``repo_id`` gets it in place of the
    placeholder path. A card of the user's own (no ``hf-rope-ext`` tag) is pushed as given."""
    from .model_card import CARD_PLACEHOLDER_REPO

    text = _card_text(card)
    if _card_patch(_card_metadata(text)) is None:
        return card
    named = sorted(set(_CARD_LOADED_REPO.findall(text)) - {repo_id, CARD_PLACEHOLDER_REPO})
    if named:
        raise ValueError(
            f"card= was rendered for the repository {named[0]!r}, not {repo_id!r} (its loading instructions name it); "
            f"render it with render_model_card(model, ..., repo_id={repo_id!r}). Nothing was pushed."
        )
    if CARD_PLACEHOLDER_REPO not in text:
        return card
    return text.replace(CARD_PLACEHOLDER_REPO, repo_id)


def _card_assets(card_assets: Any) -> list[Path]:
    """The files to copy beside the card, each checked to exist before anything is written."""
    if isinstance(card_assets, (str, os.PathLike)):
        card_assets = [card_assets]
    assets = []
    for asset in card_assets:
        if not isinstance(asset, (str, os.PathLike)):
            raise TypeError(f"card_assets must be file paths, got {asset!r}.")
        path = Path(asset).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"card asset {path} is not a file.")
        assets.append(path)
    names = [path.name for path in assets]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(
            f"card_assets has several files named {repeated}; they would overwrite each other beside the card."
        )
    return assets


def _card_of_another_patch(folder: Path, recorded: PatchSpec) -> bool:
    """True when ``folder``'s README.md is a card hf_rope_ext generated (its metadata has the
    ``hf-rope-ext`` tag) for another patch than ``recorded``: the one its metadata names, or for an
    older card that names none, the one the checkpoint there records."""
    from huggingface_hub import metadata_load

    from .model_card import card_patch_metadata

    try:
        described = _card_patch(metadata_load(folder / _CARD) or {})
        if described and (_names_whole_patch(described) or not _describes(described, recorded)):
            return not _describes(described, recorded)  # the card names the patch it describes
        # An older card, naming no patch or only its method and scale: the one the checkpoint there records.
        previous = json.loads((folder / "config.json").read_text(encoding="utf-8")).get(config_io.RECORD_ATTRIBUTE)
    except Exception:  # a README or config of the user's own, in whatever form: not ours to judge
        return False
    if described is None:
        return False

    def patch_of(record: Any) -> Any:  # the record less the version of the package that wrote it
        return {key: value for key, value in record.items() if key != "version"} if isinstance(record, dict) else record

    return patch_of(previous) != card_patch_metadata(recorded)


def _raise_kept_tokenizer_limit(kept: Path, staging: Path, extended: int) -> None:
    """Write into ``staging`` a copy of the folder's ``tokenizer_config.json`` whose finite
    ``model_max_length`` below ``extended`` is raised to it, as :func:`_save_tokenizer` does: an
    earlier save may have raised it for a shorter extended context, and vLLM caps its length by it."""
    try:
        settings = json.loads(kept.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return  # not a tokenizer config this could read: left as it is
    previous = settings.get("model_max_length") if isinstance(settings, dict) else None
    if isinstance(previous, int) and not isinstance(previous, bool) and previous < extended:
        settings["model_max_length"] = extended
        (staging / kept.name).write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        logger.info("Raised model_max_length in %s from %d to the extended context %d.", kept, previous, extended)


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


def _check_saved_config(folder: Path, live_config: Any, recorded: PatchSpec) -> None:
    saved = read_checked_config(folder)
    config_io.verify_record(saved)
    expected = {**live_config.rope_parameters, **recorded.kept}
    read_back = dict(saved.rope_parameters)
    if "attn_factor" not in expected:  # written for older runtimes only (config_io.legacy_fields)
        read_back.pop("attn_factor", None)
    if read_back != expected or saved.max_position_embeddings != live_config.max_position_embeddings:
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

    ``api`` defaults to ``huggingface_hub.HfApi()``; the repository is created if missing, and
    so is the branch ``revision`` names (as transformers' ``push_to_hub`` does).
    Weight files an earlier push left in the repository (``model*.safetensors``, shard
    indexes, ``pytorch_model*.bin``, adapter files) are deleted in the same commit, as
    :func:`save_patched` does locally; other files (a README, tokenizer files) are overwritten
    by the new ones where given and otherwise left: without ``tokenizer=``, the repository's
    ``tokenizer_config.json`` keeps its ``model_max_length`` (a warning says so). A card
    hf_rope_ext rendered for another repository is refused; one rendered without ``repo_id``
    gets ``repo_id`` in its loading instructions. Returns the ``CommitInfo`` of the upload.
    """
    if "push_to_hub" in save_kwargs:
        raise ValueError(
            "push_patched_to_hub uploads the checked folder itself; leave out push_to_hub (save_pretrained would push "
            "the unfinished one)."
        )
    _refuse_unknown_save_kwargs(model, save_kwargs, "push_patched_to_hub")
    recorded = _recorded_patch(model)
    if card is not None:
        card = _card_for_repo(card, repo_id)
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()
    message = commit_message or (
        f"Upload {recorded.method} x{recorded.scale:g} patched model "
        f"({recorded.original_max_position_embeddings} -> {recorded.extended_context} tokens) with hf-rope-ext"
    )
    with tempfile.TemporaryDirectory(prefix="hf_rope_ext-push-") as folder:
        save_patched(model, folder, tokenizer=tokenizer, card=card, card_assets=card_assets, **save_kwargs)
        if tokenizer is None:
            # A local save raises the limit of a tokenizer_config.json already in the folder; the
            # repository's copy is not read here, so a limit an earlier push left below the new
            # context would stay (vLLM caps its length by it).
            logger.warning(
                "Pushing without tokenizer=: a tokenizer_config.json already in %s keeps its model_max_length, which "
                "vLLM caps the length by; pass tokenizer= to upload one raised to the extended context %d.",
                repo_id, recorded.extended_context,
            )  # fmt: skip
        api.create_repo(repo_id, token=token, private=private, exist_ok=True)
        if revision is not None and not revision.startswith("refs/pr/"):
            # A commit to a branch that does not exist is refused (transformers' push_to_hub does the same).
            api.create_branch(repo_id, branch=revision, token=token, exist_ok=True)
        return api.upload_folder(
            repo_id=repo_id,
            folder_path=folder,
            commit_message=message,
            token=token,
            revision=revision,
            create_pr=create_pr,
            delete_patterns=_WEIGHT_PATTERNS,
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
    parent, attribute = owner_and_attribute(model, module_name)
    saved = compat.snapshot_config(config, (config_io.RECORD_ATTRIBUTE, "original_max_position_embeddings"))
    try:
        rope, max_positions = recorded.original_rope_config()
        compat.write_rope_config(config, rope, max_positions)
        delattr(config, config_io.RECORD_ATTRIBUTE)  # the patch writes a new one; unpatch removes it
        if recorded.method == "longrope" and getattr(config, "original_max_position_embeddings", None) == (
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
        rotated, factor = 2 * fresh.inv_freq.shape[-1], recorded.kept.get("partial_rotary_factor")
        if rotated != recorded.rotary_dim and factor is not None and rotated == config_io.head_dim_of(config):
            # An untabled family (mixtral, olmo) saved before the factor was read from the module.
            raise ValueError(config_io.ignored_factor_message(config, factor))
        setattr(parent, attribute, fresh)
        recorded.apply(model)
    except Exception:
        setattr(parent, attribute, loaded)
        compat.restore_config(config, saved)
        raise
    logger.info("Restored the %s patch (scale %g) on %s.", recorded.method, recorded.scale, module_name)
    return model


_CONFIG_KWARGS = ("cache_dir", "force_download", "local_files_only", "proxies", "revision", "subfolder", "token")
# Keyword arguments from_pretrained uses itself even where the config has an attribute of the name.
_FROM_PRETRAINED_OWN = (*_CONFIG_KWARGS, "dtype", "torch_dtype", "quantization_config")
# Config fields the hf_rope_ext record is checked against (config_io.verify_record), or that set
# the rotary dimension it was computed for.
_ROPE_FIELDS = (
    config_io.RECORD_ATTRIBUTE, "rope_parameters", "rope_scaling", "rope_theta", "max_position_embeddings",
    "original_max_position_embeddings", "partial_rotary_factor", "head_dim",
)


def read_checked_config(name_or_path: str | os.PathLike, **config_kwargs: Any):
    """``AutoConfig.from_pretrained``, after checking that config.json's ``rope_parameters`` and
    legacy ``rope_scaling`` agree (:func:`hf_rope_ext.config_io.check_rope_spellings`)."""
    from transformers import AutoConfig, PretrainedConfig
    from huggingface_hub.errors import StrictDataclassError

    from .loading import check_hub_model, expand_home, is_missing_folder

    name_or_path = expand_home(name_or_path)
    if is_missing_folder(name_or_path):
        raise FileNotFoundError(f"Checkpoint folder not found: {name_or_path}.")
    if Path(name_or_path).is_file():  # config.json itself, or a weights file: transformers calls it bad JSON
        raise ValueError(
            f"{name_or_path} is a file; pass the checkpoint folder that holds it ({Path(name_or_path).parent})."
        )
    check_hub_model(str(name_or_path), **config_kwargs)
    subfolder = config_kwargs.get("subfolder") or ""
    folder = Path(name_or_path) / subfolder
    if Path(name_or_path).is_dir() and not (folder / "config.json").is_file():
        if subfolder and not folder.is_dir():
            raise FileNotFoundError(f"{name_or_path} has no subfolder {subfolder!r}; check subfolder=.")
        raise FileNotFoundError(
            f"{folder} has no config.json, so it is not a checkpoint folder (one written by save_patched or "
            "save_pretrained)."
        )
    if (folder / "config.json").is_file():
        # transformers fails on a JSON value that is not an object with a raw TypeError.
        try:
            local = json.loads((folder / "config.json").read_text())
        except ValueError:  # not JSON (or not UTF-8): transformers' own message says so
            local = {}
        config_io.check_rope_types(local, str(name_or_path))
    raw, _ = PretrainedConfig.get_config_dict(name_or_path, **config_kwargs)
    config_io.check_rope_types(raw, str(name_or_path))
    config_io.check_rope_spellings(raw, str(name_or_path))
    try:
        return AutoConfig.from_pretrained(name_or_path, **config_kwargs)
    except StrictDataclassError as error:
        # transformers validates field types with huggingface_hub's strict dataclasses: a hand-edited
        # value of the wrong type ends there, in a multi-line message.
        raise ValueError(
            f"{name_or_path}/config.json has a value of the wrong type: {' '.join(str(error).split())} Restore the "
            "file as it was written, or fix that field."
        ) from None


def load_patched(name_or_path: str | os.PathLike, *, restore: bool = True, **from_pretrained_kwargs: Any) -> Any:
    """Load a causal LM saved from a patched model, by folder or Hub repo id.

    The config is read and its ``hf_rope_ext`` record checked before the model is built, so
    an edited or corrupt config.json is refused with an error naming the contradiction.
    With ``restore=True`` (default) the patch is rebuilt with :func:`restore_patch`;
    ``restore=False`` returns what ``from_pretrained`` built. A checkpoint without a record
    loads as plain transformers loads it. ``config=`` may be a ``PretrainedConfig`` or the
    folder or Hub id of one, read and checked like the checkpoint's own; a patched model's
    config is used with that model's own attention implementation, not its patch's. Keyword
    arguments that are config attributes (``use_cache=False``) are set on that config, as
    ``from_pretrained`` does; those that would change the RoPE fields the record describes
    (``rope_parameters``, ``max_position_embeddings``, ...) are refused, those equal to the
    config's values are not. Other keyword arguments go to ``from_pretrained``; with
    ``output_loading_info=True`` the result is ``(model, loading_info)``, as there.
    """
    from transformers import AutoModelForCausalLM, PretrainedConfig

    from .loading import expand_home

    name_or_path = expand_home(name_or_path)
    restore_interrupted_save(name_or_path)  # a save killed half way leaves neither version until then
    model_kwargs = dict(from_pretrained_kwargs)
    config = model_kwargs.pop("config", None)
    given_config = config if config is None or isinstance(config, (str, os.PathLike)) else type(config).__name__
    config_kwargs = {key: model_kwargs[key] for key in _CONFIG_KWARGS if key in model_kwargs}
    if config is None or isinstance(config, (str, os.PathLike)):
        config = read_checked_config(name_or_path if config is None else expand_home(config), **config_kwargs)
    elif isinstance(config, PretrainedConfig):
        config = copy.deepcopy(config)  # the overrides below are for this load, not the caller's object
        # A patched model's config names that model's attention patch, which the new model is no part of.
        own = implementation_behind(getattr(config, "_attn_implementation", None))
        if own is not None:
            config._attn_implementation = own
    else:
        raise TypeError(
            f"config must be a PretrainedConfig or the folder or Hub id of one, got {type(config).__name__}."
        )
    recorded = config_io.verify_record(config)
    rope_kwargs = [key for key in model_kwargs if key in _ROPE_FIELDS]
    changed_rope = [key for key in rope_kwargs if _changes(config, key, model_kwargs[key])]
    for key in set(rope_kwargs) - set(changed_rope):
        del model_kwargs[key]  # the checkpoint's own value: nothing to set
    if recorded is not None and changed_rope:
        raise ValueError(
            f"load_patched({', '.join(f'{key}=...' for key in changed_rope)}) would change the RoPE fields that the "
            f"checkpoint's {recorded.label} x{recorded.scale:g} record describes; load it without them, then "
            "unpatch_model(model) and patch_model(model, ...) for another patch."
        )
    # from_pretrained sets the keyword arguments that are config attributes on a config it reads
    # itself, and passes all of them to the model's __init__ (a TypeError) with config= given.
    for key in [key for key in model_kwargs if key not in _FROM_PRETRAINED_OWN and hasattr(config, key)]:
        setattr(config, key, model_kwargs.pop(key))
    # Without a record, from_pretrained's own warning (an attention-level rope_type whose frequencies
    # only it rebuilds) must reach the user. With one, that warning names load_patched: restore
    # rebuilds the attention, and restore=False gets the warning below, which names the fix.
    with config_io.restoring_patch() if recorded is not None else contextlib.nullcontext():
        loaded = AutoModelForCausalLM.from_pretrained(name_or_path, config=config, **model_kwargs)
    # output_loading_info=True: from_pretrained returns (model, loading_info), given back as it is
    model = loaded[0] if model_kwargs.get("output_loading_info") else loaded
    if recorded is None and given_config is not None:
        logger.info("The config= given (%s) has no hf_rope_ext record, so %s was loaded as transformers reads it with "
                    "that config (a record in the checkpoint's own config.json is not read).",
                    given_config, name_or_path)  # fmt: skip
    elif recorded is None:
        logger.info("%s has no hf_rope_ext record; loaded as transformers reads it.", name_or_path)
    elif restore:
        restore_patch(model)
    elif recorded.rope_method.attention is not None or recorded.logn_attention:
        logger.warning(
            "%s holds the attention-level patch %r; with restore=False, transformers' rotary module rebuilds its "
            "frequencies only, so inputs beyond %d tokens are not read as patched. Call "
            "hf_rope_ext.hub.restore_patch(model) on it, or load with restore=True.",
            name_or_path, recorded.label, recorded.original_max_position_embeddings,
        )  # fmt: skip
    return loaded


def _changes(config: Any, key: str, value: Any) -> bool:
    """Whether ``setattr(config, key, value)``, which from_pretrained does, changes the config: a value
    equal to the checkpoint's does not (``rope_scaling`` is compared as transformers reads it, into
    ``rope_parameters``). A key the config has no attribute for is compared with ``rope_parameters``
    (``rope_theta`` lives there in transformers 5), and a legacy ``rope_scaling`` without
    ``rope_theta`` takes the config's, written beside it in config.json."""
    parameters = getattr(config, "rope_parameters", None)
    parameters = parameters if isinstance(parameters, dict) else {}
    if not hasattr(config, key):
        return not (key in parameters and parameters[key] == value)
    value = copy.deepcopy(value)  # the trial below must not change the caller's object
    if key == "rope_scaling" and isinstance(value, dict) and "rope_theta" in parameters:
        value.setdefault("rope_theta", parameters["rope_theta"])
    trial = copy.deepcopy(config)
    with warnings.catch_warnings():  # transformers' FutureWarning for rope_scaling: given once, when it is set
        warnings.simplefilter("ignore", FutureWarning)
        setattr(trial, key, value)
    return trial.to_dict() != config.to_dict()
