"""``method="auto"``: choose the configuration for a model and a target length by measuring.

Each candidate configuration (a method and its parameters) is applied in turn and scored by the
mean token loss of one forward over the first ``length`` tokens of a calibration text (natural
log; ``exp`` of it is the perplexity of those tokens). The lowest loss wins; ties keep the earlier
candidate, so list the one you prefer first. By default the score pools every position of the
forward, which is what a reader of a long document gets; ``objective="beyond"`` scores only the
positions beyond the native context. The numbers behind the choice are returned, logged as a
table, and cached per model (a fingerprint of its config and weights) in
``$HF_ROPE_EXT_CACHE/auto/<fingerprint>.json``, so the same question is answered at once the
next time. The question includes the model's fingerprint, weights dtype, autocast state and
attention implementation, so a shared ``cache_path`` never answers one model (or precision)
with another's numbers; processes sharing the file take turns to write it. The candidates are
measured in eval mode (no dropout) whatever the model's mode, which is put back afterwards.
Candidates of user-registered methods are measured every time, never cached: the cache could
not tell their numbers from those of another version of the method under the same name::

    from hf_rope_ext import patch_model
    ids = tokenizer(long_text, return_tensors="pt").input_ids[0]
    patch_model(model, scale=2, method="auto", calibration_ids=ids)          # all candidates
    choice = choose_configuration(model, ids, scale=2, candidates="servable")  # vLLM/llama.cpp too

Candidate sets: ``"all"`` (default) is dynamic-yarn, self-extend-yarn (the default method),
self-extend with ``W = L0/2`` and ``W = L0/4``, self-extend with log-n attention, and
dual-chunk; ``"servable"`` is the methods that vLLM and llama.cpp reproduce exactly from a saved
checkpoint (yarn, ntk). A list of
``"method[:key=value,...]"`` strings (values in JSON) gives your own.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import numbers
import os
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from .files import atomic_write_json
from .validation import is_finite

logger = logging.getLogger(__name__)

__all__ = [
    "AutoChoice",
    "CandidateScore",
    "candidate_configurations",
    "check_configurations",
    "choose_configuration",
    "parse_configuration",
]

OBJECTIVES = ("all", "beyond")
CANDIDATE_SETS = ("all", "servable")
# Bumped when the scoring changes, so cached choices made by other code are not reused.
# 2: measured in eval mode (version 1 measured a model in training mode with its dropout).
_SCORING_VERSION = 2


_BARE_WORD = re.compile(r"[A-Za-z][A-Za-z0-9_.-]*")


def parse_configuration(text: str) -> tuple[str, dict[str, Any]]:
    """``"self-extend:neighbor_window=2048,group_size=3"`` -> ``("self-extend", {...})``.

    Values are JSON (numbers, true/false, null, quoted strings) or bare words (``by-parts``); the
    method name may carry ``+logn``.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"a configuration is 'method[:key=value,...]', got {text!r}.")
    method, _, rest = text.strip().partition(":")
    params: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"configuration {text!r}: parameter {item!r} is not key=value.")
        if key in params:
            raise ValueError(f"configuration {text!r} gives {key} more than once; give it once.")
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            if not _BARE_WORD.fullmatch(value.strip()):
                raise ValueError(
                    f"configuration {text!r}: value {value!r} is not a number, true/false, null or a word."
                ) from None
            params[key] = value.strip()  # a name, such as far_positions=by-parts
    if not method.strip():
        raise ValueError(f"configuration {text!r} names no method.")
    return method.strip(), params


def check_configurations(
    model: nn.Module, texts: Sequence[str], scale: Any, *, original_max_length: int | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """Parse ``texts`` and check each configuration on ``model`` before a long run uses it.

    Each one is patched and unpatched at once (``unpatch_model`` restores the model bitwise), so
    every check :func:`hf_rope_ext.patch_model` makes for this model (method, parameters, scale,
    attention implementation) fails here, in one ``ValueError`` that names the configuration,
    rather than after the forwards that came before it. ``"none"`` (the unpatched model) is not
    patched. Afterwards, also when a configuration is refused, the model has the patch it had
    before (or none), with the same config object and values (changes made since patching are
    kept). ``original_max_length`` as in ``patch_model``. Returns the parsed ``(method, params)``
    pairs.
    """
    from .patching import _patch_to_put_back, _put_back, patch_model, unpatch_model

    if isinstance(texts, str) or not isinstance(texts, Sequence) or not texts:
        raise ValueError(f"give at least one configuration 'method[:key=value,...]' ('none' = unpatched), got {texts!r}.")
    previous = _patch_to_put_back(model)
    configurations = []
    try:
        for text in texts:
            method, params = parse_configuration(text)
            if method != "none":
                try:
                    patch_model(model, scale, method, original_max_length=original_max_length, **params)
                except (ValueError, TypeError) as error:
                    raise ValueError(f"configuration {text!r}: {error}") from error
                unpatch_model(model)
            configurations.append((method, params))
    finally:
        _put_back(model, previous)  # patch_model started from the original model, dropping this patch
    return configurations


def _configuration_text(method: str, params: Mapping[str, Any]) -> str:
    if not params:
        return method
    return method + ":" + ",".join(f"{key}={json.dumps(value)}" for key, value in sorted(params.items()))


def candidate_configurations(candidates: str | Sequence[str], original_length: int) -> list[str]:
    """The candidate configurations as ``method[:key=value,...]`` strings, parsed and checked."""
    if isinstance(candidates, str):
        if candidates == "all":
            return ["dynamic-yarn", "self-extend-yarn", "self-extend", f"self-extend:neighbor_window={max(1, original_length // 4)}",
                    "self-extend+logn", "dual-chunk"]  # fmt: skip
        if candidates == "servable":
            return ["yarn", "ntk"]
        raise ValueError(
            f"candidates={candidates!r}: give {' or '.join(map(repr, CANDIDATE_SETS))}, or a list of "
            "'method[:key=value,...]' strings."
        )
    if not isinstance(candidates, Sequence) or not candidates:
        raise ValueError(f"candidates must be 'all', 'servable' or a non-empty list of configurations, got {candidates!r}.")
    texts = []
    for candidate in candidates:
        method, params = parse_configuration(candidate)
        if method == "auto":
            raise ValueError("candidates cannot include 'auto' itself.")
        texts.append(_configuration_text(method, params))
    duplicates = sorted({text for text in texts if texts.count(text) > 1})
    if duplicates:
        raise ValueError(f"candidates list {', '.join(duplicates)} more than once.")
    return texts


@dataclass(frozen=True)
class CandidateScore:
    """One candidate's calibration result."""

    configuration: str
    mean_loss: float  # over the scored positions (the objective)
    perplexity: float  # exp(mean_loss)
    perplexity_inside: float | None  # positions 1 .. L0 - 1 of the forward
    perplexity_beyond: float  # positions L0 .. length - 1
    seconds: float


@dataclass(frozen=True)
class AutoChoice:
    """What :func:`choose_configuration` measured and chose."""

    chosen: str  # the winning configuration, "method[:key=value,...]"
    method: str
    params: dict[str, Any]
    scale: float
    length: int  # calibration tokens per forward
    original_length: int
    objective: str
    scores: tuple[CandidateScore, ...]
    calibration_sha256: str
    from_cache: bool = False
    cache_path: str | None = field(default=None, compare=False)  # the file holding it (None: not cached)

    def table(self) -> str:
        """The numbers behind the choice, as a markdown table."""
        lines = [
            f"method='auto', scale {self.scale:.10g}, calibration {self.length} tokens, objective {self.objective!r}"
            + (" (cached)" if self.from_cache else ""),
            f"| configuration | mean loss | ppl | ppl 1-{self.original_length} | ppl {self.original_length}-{self.length} | seconds |",
            "|---|---|---|---|---|---|",
        ]
        for score in self.scores:
            mark = " (chosen)" if score.configuration == self.chosen else ""
            inside = "" if score.perplexity_inside is None else f"{score.perplexity_inside:.3f}"
            lines.append(
                f"| {score.configuration}{mark} | {score.mean_loss:.5f} | {score.perplexity:.3f} | {inside} | "
                f"{score.perplexity_beyond:.3f} | {score.seconds:.1f} |"
            )
        return "\n".join(lines)


def _calibration_tensor(calibration_ids: Any) -> torch.Tensor:
    if calibration_ids is None:
        raise ValueError(
            "method='auto' needs calibration_ids=: the token ids of a text longer than the model's native context "
            "(e.g. tokenizer(text, return_tensors='pt').input_ids[0])."
        )
    if isinstance(calibration_ids, str):
        raise TypeError("calibration_ids must be token ids, not text: tokenize it first (tokenizer(text).input_ids).")
    try:
        ids = torch.as_tensor(calibration_ids)
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(f"calibration_ids must be a 1-D sequence of token ids ({error}).") from None
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"calibration_ids must be one sequence of token ids (1-D), got shape {tuple(ids.shape)}.")
    # an empty list becomes a float tensor: its problem is its length (_checked_length), not its type
    if ids.numel() and (ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool):
        raise TypeError(f"calibration_ids must be integer token ids, got dtype {ids.dtype}.")
    return ids.to(torch.long).cpu()


def _checked_length(length: Any, available: int, original_length: int, target_length: int) -> int:
    # The messages say "calibration length": the option is length= here, calibration_length= in
    # patch_model and --length on the command line.
    if length is None:
        if available <= original_length:
            raise ValueError(
                f"the calibration forward must be longer than the native context of {original_length} tokens to tell "
                f"the candidates apart, and the calibration text has only {available} tokens. Give a longer one."
            )
        length = min(available, target_length)
    elif isinstance(length, bool) or not isinstance(length, numbers.Integral):
        raise TypeError(f"the calibration length must be a whole number of tokens, got {length!r}.")
    length = int(length)  # numpy and torch integers too
    if length <= original_length:
        raise ValueError(
            f"the calibration forward must be longer than the native context of {original_length} tokens to tell "
            f"the candidates apart; got a calibration length of {length}. Give a larger one."
        )
    if length > available:
        raise ValueError(f"calibration length {length}, but the calibration text has only {available} tokens.")
    if length > target_length:
        raise ValueError(
            f"calibration length {length} is beyond the target context of {target_length} tokens (scale x native)."
        )
    return length


def _cache_file(fingerprint: str, cache_dir: str | Path | None) -> Path:
    from .loading import cache_dir as default_cache_dir

    return Path(cache_dir) if cache_dir is not None else default_cache_dir() / "auto" / f"{fingerprint}.json"


def _not_a_cache(path: Path) -> str | None:
    """Why ``path`` is not a calibration cache this package may overwrite (None: it is one, or missing).

    Only a file holding exactly ``{"entries": {...}}`` (what choose_configuration writes) is ours:
    a user's cache_path naming anything else is never overwritten.
    """
    if path.is_dir():
        return "is a folder"
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:  # UnicodeDecodeError is a ValueError
        return f"is not JSON ({error})"
    if not isinstance(data, dict) or set(data) != {"entries"} or not isinstance(data["entries"], dict):
        return 'is not a calibration cache (a JSON object {"entries": {...}})'
    return None


def _read_cache(path: Path, report: bool = True) -> dict[str, Any]:
    """The cache file's entries by key; a missing file is empty, an unreadable one is reported and ignored."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        entries = data["entries"]
        if not isinstance(entries, dict):
            raise TypeError("'entries' is not an object")
        return entries
    except (OSError, ValueError, KeyError, TypeError) as error:
        if report:
            logger.warning("Ignoring the calibration cache %s (%s); it will be rewritten.", path, error)
        return {}


def _choice_from_entry(entry: Any, key_fields: Mapping[str, Any], path: Path) -> AutoChoice | None:
    try:
        scores = tuple(CandidateScore(**score) for score in entry["scores"])
        configurations = [score.configuration for score in scores]
        if configurations != list(key_fields["candidates"]) or entry["chosen"] not in configurations:
            raise ValueError("its scores do not match its candidates")
        for score in scores:
            values = [score.mean_loss, score.perplexity, score.perplexity_beyond, score.seconds]
            values += [] if score.perplexity_inside is None else [score.perplexity_inside]
            if not all(is_finite(value) for value in values):
                raise ValueError(f"a number of {score.configuration!r} is missing or not finite")
            if not _consistent(score, key_fields):
                raise ValueError(f"the perplexities of {score.configuration!r} do not follow from its mean loss")
        best = min(scores, key=lambda score: score.mean_loss)  # first of equals, as when measured
        if entry["chosen"] != best.configuration:
            raise ValueError(f"it names {entry['chosen']!r}, not the lowest loss ({best.configuration!r})")
        method, params = parse_configuration(entry["chosen"])
    except (KeyError, TypeError, ValueError) as error:
        logger.warning("Ignoring a damaged entry of the calibration cache %s (%s); measuring again.", path, error)
        return None
    return AutoChoice(
        chosen=entry["chosen"], method=method, params=params, scale=key_fields["scale"], length=key_fields["length"],
        original_length=key_fields["original_length"], objective=key_fields["objective"], scores=scores,
        calibration_sha256=key_fields["calibration_sha256"], from_cache=True, cache_path=str(path),
    )  # fmt: skip


def _consistent(score: CandidateScore, key_fields: Mapping[str, Any]) -> bool:
    """Whether a cached score's perplexities are those its mean loss was measured with.

    The forward scores ``length - 1`` tokens: ``L0 - 1`` inside the native context, the rest
    beyond it; objective "all" averages both, "beyond" the second only.
    """
    perplexities = (score.perplexity, score.perplexity_beyond, score.perplexity_inside)
    if any(value is not None and value <= 0 for value in perplexities):
        return False
    inside_count, beyond_count = key_fields["original_length"] - 1, key_fields["length"] - key_fields["original_length"]
    beyond_total = math.log(score.perplexity_beyond) * beyond_count
    inside_total = 0.0 if score.perplexity_inside is None else math.log(score.perplexity_inside) * inside_count
    if key_fields["objective"] == "all":
        expected = (inside_total + beyond_total) / (inside_count + beyond_count)
    else:
        expected = beyond_total / beyond_count
    return math.isclose(math.log(score.perplexity), score.mean_loss, rel_tol=1e-9, abs_tol=1e-9) and math.isclose(
        expected, score.mean_loss, rel_tol=1e-6, abs_tol=1e-6
    )


def _score(model: nn.Module, ids: torch.Tensor, original_length: int, objective: str) -> tuple[float, float | None, float]:
    from .evaluation.perplexity import token_losses

    losses = token_losses(model, ids).double()  # losses[t - 1] scores token t
    inside, beyond = losses[: original_length - 1], losses[original_length - 1 :]
    scored = losses if objective == "all" else beyond
    mean_inside = float(inside.mean()) if inside.numel() else None
    return float(scored.mean()), mean_inside, float(beyond.mean())


def choose_configuration(
    model: nn.Module,
    calibration_ids: Any,
    scale: float | None = None,
    *,
    max_length: int | None = None,
    original_max_length: int | None = None,
    length: int | None = None,
    candidates: str | Sequence[str] = "all",
    objective: str = "all",
    cache: bool = True,
    cache_path: str | Path | None = None,
    progress: bool = True,
) -> AutoChoice:
    """Measure each candidate configuration on the calibration text and return the best.

    Args:
        model: a loaded causal LM (patched or not; it is left as it was).
        calibration_ids: 1-D token ids of a text longer than the native context, ideally like
            the texts the model will read (not the ones you evaluate on).
        scale, max_length, original_max_length: the target, as for :func:`hf_rope_ext.patch_model`.
        length: tokens per calibration forward; default the target length, or the whole text
            if shorter. Must be beyond the native context. Each candidate costs one forward.
        candidates: ``"all"``, ``"servable"`` or a list of ``"method[:key=value,...]"``.
        objective: ``"all"`` (mean loss of every position) or ``"beyond"`` (positions past the
            native context only).
        cache: read and write the per-model cache; ``cache_path`` (``~`` expanded; refused with
            ``cache=False``) overrides its file, which must be missing or a cache written here
            (anything else is refused, never overwritten). Candidate lists with a
            user-registered method are not cached.
        progress: show a progress bar over the candidates.

    The candidates are checked (as :func:`hf_rope_ext.patch_model` checks them, in the model's
    own mode) before the cache is read, and measured in eval mode; the model is left in its
    modes and with its patch.
    """
    from .evaluation.perplexity import eval_mode
    from .evaluation.runner import model_fingerprint
    from .methods import is_builtin
    from .patching import _patch_to_put_back, _put_back, _rotary_target, get_patch_info, original_context_length
    from .patching import patch_model, unpatch_model
    from .spec import extended_length, resolve_scale

    if objective not in OBJECTIVES:
        raise ValueError(f"objective={objective!r}: give {' or '.join(map(repr, OBJECTIVES))}.")
    if not isinstance(cache, bool):
        raise TypeError(f"cache must be True or False, got {cache!r}.")
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be True or False, got {progress!r}.")
    if cache_path is not None:
        if not cache:
            raise ValueError(f"cache_path={str(cache_path)!r} was given with cache=False, which neither reads nor "
                             "writes it; drop cache_path to measure without a cache, or drop cache=False to use "
                             "that file.")  # fmt: skip
        if not isinstance(cache_path, (str, os.PathLike)):
            raise TypeError(f"cache_path must be a file path (str or pathlib.Path), got {cache_path!r}.")
        from .loading import home_expanded

        cache_path = home_expanded(cache_path, "cache_path")  # as HF_ROPE_EXT_CACHE is
        if (problem := _not_a_cache(cache_path)) is not None:
            raise ValueError(f"cache_path {cache_path} {problem}; it would be overwritten: give a new file name or the "
                             f"path of a cache written here.")  # fmt: skip
    ids = _calibration_tensor(calibration_ids)
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocabulary = getattr(embeddings, "num_embeddings", None)
    if ids.numel() and (int(ids.min()) < 0 or (vocabulary is not None and int(ids.max()) >= vocabulary)):
        raise ValueError(
            f"calibration_ids holds ids outside the model's vocabulary (0 .. {vocabulary - 1 if vocabulary else '?'}): "
            f"{int(ids.min())} .. {int(ids.max())}. Tokenize with the model's own tokenizer."
        )
    previous = _patch_to_put_back(model)
    measuring = contextlib.ExitStack()
    try:
        target = _rotary_target(model)  # unpatches, so the fingerprint and the scores start from the original model
        original_length = original_context_length(target.config, original_max_length)
        resolved_scale = resolve_scale(scale, max_length, original_length)
        target_length = extended_length(original_length, resolved_scale)
        length = _checked_length(length, ids.numel(), original_length, target_length)
        configurations = candidate_configurations(candidates, original_length)
        ids = ids[:length]
        # Every candidate is checked before the first forward, and before the cache is read: a
        # cached answer must not name a method that is no longer registered. Checked in the
        # caller's mode, as patch_model(method="auto") applies the choice in it.
        user_methods = []
        for configuration in configurations:
            method, params = parse_configuration(configuration)
            try:
                patch_model(model, resolved_scale, method, original_max_length=original_length, **params)
            except (ValueError, TypeError) as error:
                raise type(error)(f"candidate {configuration!r}: {error}") from None
            if not is_builtin(get_patch_info(model).method):
                user_methods.append(configuration)
            unpatch_model(model)
        # measured in eval mode (with dropout on the losses are noise), every module's mode put back after
        measuring.enter_context(eval_mode(model))
        # The model, its precision (weights and autocast) and its attention kernel are part of the
        # question: the same weights in bf16 (whose fingerprint equals fp32's) or another model
        # sharing cache_path must not be answered with these numbers.
        fingerprint = model_fingerprint(model)
        key_fields = {
            "scale": resolved_scale, "length": length, "original_length": original_length, "objective": objective,
            "candidates": configurations, "calibration_sha256": hashlib.sha256(ids.numpy().tobytes()).hexdigest(),
            "scoring_version": _SCORING_VERSION, "model_fingerprint": fingerprint,
            "dtypes": sorted({str(parameter.dtype) for parameter in model.parameters()}),
            "autocast": _autocast_state(model), "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "attn_implementation": getattr(getattr(model, "config", None), "_attn_implementation", None),
        }  # fmt: skip
        key = json.dumps(key_fields, sort_keys=True)
        if cache and user_methods:
            # A user-registered method's code can change under the same name; the key could not
            # tell its numbers from those of the code that runs now.
            (logger.warning if cache_path is not None else logger.info)(
                "Not caching this calibration: %s use a user-registered method, whose code the cache cannot tell "
                "apart from a later version under the same name; it is measured each time.", ", ".join(user_methods)
            )  # fmt: skip
        path = _cache_file(fingerprint, cache_path) if cache and not user_methods else None
        entries = _read_cache(path) if path is not None else {}
        if key in entries:
            choice = _choice_from_entry(entries[key], key_fields, path)
            if choice is not None:
                logger.info("Calibration found in %s:\n%s", path, choice.table())
                return choice
        scores = []
        for configuration in tqdm(configurations, desc=f"auto: {length}-token calibration", disable=not progress):
            method, params = parse_configuration(configuration)
            patch_model(model, resolved_scale, method, original_max_length=original_length, **params)
            try:
                start = time.perf_counter()
                mean_loss, mean_inside, mean_beyond = _score(model, ids, original_length, objective)
                seconds = time.perf_counter() - start
            finally:
                unpatch_model(model)
            if not math.isfinite(mean_loss):
                raise ValueError(f"candidate {configuration!r} gave a non-finite loss ({mean_loss}) on the calibration text.")
            scores.append(CandidateScore(
                configuration, mean_loss, math.exp(mean_loss),
                None if mean_inside is None else math.exp(mean_inside), math.exp(mean_beyond), seconds,
            ))  # fmt: skip
        best = min(range(len(scores)), key=lambda index: scores[index].mean_loss)  # first of equals
        chosen = scores[best].configuration
        entry = {"chosen": chosen, "scores": [asdict(score) for score in scores]}
        written = path is not None and _write_cache_entry(path, key, entry, user_file=cache_path is not None)
        method, params = parse_configuration(chosen)
        choice = AutoChoice(
            chosen=chosen, method=method, params=params, scale=resolved_scale, length=length,
            original_length=original_length, objective=objective, scores=tuple(scores),
            calibration_sha256=key_fields["calibration_sha256"], cache_path=str(path) if written else None,
        )  # fmt: skip
        logger.info("Calibration:\n%s", choice.table())
        return choice
    finally:
        measuring.close()
        _put_back(model, previous)  # its patch, with the config object and rotary mode it had


def _autocast_state(model: nn.Module) -> dict[str, str | None]:
    """The autocast dtype (None: off) for each device type the model computes on: a forward under
    ``torch.autocast`` runs in that precision whatever the weights' dtype."""
    device_types = {parameter.device.type for parameter in model.parameters()} - {"meta"}
    for device in (getattr(model, "hf_device_map", None) or {}).values():  # accelerate's placement
        if isinstance(device, int):  # a GPU index
            device_types.add("cuda")
        elif device != "disk":
            device_types.add(torch.device(device).type)
    state = {}
    for device_type in sorted(device_types):
        try:
            enabled = torch.is_autocast_enabled(device_type)
        except RuntimeError:  # a device type autocast does not know
            enabled = False
        state[device_type] = str(torch.get_autocast_dtype(device_type)) if enabled else None
    return state


def _write_cache_entry(path: Path, key: str, entry: dict[str, Any], *, user_file: bool) -> bool:
    """Add ``entry`` to the cache file, keeping the entries other processes wrote meanwhile.
    Returns whether it was written (a failure is logged: the measurements stand)."""
    from .files import folder_lock

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Held from the re-read to the rename, so that another process's entry written in between
        # is not lost; the folder is locked, as the file itself is replaced by the rename.
        with folder_lock(path.parent, wait=True):
            if user_file and (problem := _not_a_cache(path)) is not None:
                # replaced by something else while measuring: the user's file is kept, the choice is not cached
                logger.warning("Not writing the calibration cache %s: it %s now; this choice is not cached.", path,
                               problem)  # fmt: skip
                return False
            entries = _read_cache(path, report=False)
            entries[key] = entry
            atomic_write_json(path, {"entries": entries})
        return True
    except OSError as error:  # the measurements stand; only the cache is lost
        logger.warning("Could not write the calibration cache %s (%s); this choice is not cached.", path, error)
        return False


# -- hf-rope-ext auto ------------------------------------------------------------------------------


def add_parser(subparsers) -> None:
    from .arguments import (
        HelpFormatter,
        add_attn_implementation_argument,
        add_device_arguments,
        add_dtype_argument,
        add_model_argument,
        add_option,
        add_text_files_argument,
    )

    parser = subparsers.add_parser(
        "auto",
        formatter_class=HelpFormatter,
        help="measure candidate configurations on a calibration text and name the best",
        description=(
            "Score each candidate configuration by the loss of one forward over the first --length tokens of a "
            "calibration text (not the text you evaluate on), print the table and the patch_model call of the best. "
            "Results are cached per model."
        ),
    )
    add_model_argument(parser)
    add_text_files_argument(parser, required=True, help="one calibration document, longer than the native context")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--scale", type=float, help="context multiplier (> 1)")
    add_option(group, "--max-length", type=int, help="target context in tokens")
    add_option(parser, "--length", type=int, default=None, help="tokens per calibration forward (default: the target)")
    add_option(parser, "--candidates", default="all",
               help="'all', 'servable' or ';'-separated method[:key=value,...] (default all)")
    add_option(parser, "--objective", default="all", choices=OBJECTIVES,
               help="score every position, or only those beyond the native context (default all)")
    add_option(parser, "--no-cache", action="store_true", help="measure again even if the answer is cached")
    add_option(parser, "--json", action="store_true", help="print the choice as JSON")
    add_device_arguments(parser)
    add_dtype_argument(parser)
    add_attn_implementation_argument(parser)
    parser.set_defaults(handler=_auto_command)


def _auto_command(args) -> int:
    from .arguments import check_attention_backend
    from .config_io import read_record
    from .data import read_text, tokenize
    from .hub import restore_patch
    from .loading import cache_dir, load_model

    if not args.no_cache:
        cache_dir()  # refuses a relative HF_ROPE_EXT_CACHE before the model loads
    if len(args.text_files) != 1:
        raise ValueError(f"give one calibration document with --text-files, got {len(args.text_files)}.")
    check_attention_backend(args.attn_implementation, device=args.device, half_precision=args.dtype != "fp32")
    candidates = args.candidates if args.candidates in CANDIDATE_SETS else [
        part.strip() for part in args.candidates.split(";") if part.strip()]  # fmt: skip
    text = read_text(args.text_files[0])
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device,
                                  attn_implementation=args.attn_implementation)  # fmt: skip
    if read_record(model.config) is not None:  # a present null is refused as an edited record
        # A checkpoint saved patched: its config holds the patched RoPE. Rebuild the patch, so the
        # candidates are measured from the original RoPE, as patch_model does after load_patched.
        restore_patch(model)
    ids = tokenize(tokenizer, text)
    try:
        choice = choose_configuration(model, ids, args.scale, max_length=args.max_length, length=args.length,
                                      candidates=candidates, objective=args.objective,
                                      cache=not args.no_cache)  # fmt: skip
    except KeyboardInterrupt:
        print("interrupted: nothing was cached for this question.", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(asdict(choice), indent=2))
    else:
        params = "".join(f", {key}={value!r}" for key, value in sorted(choice.params.items()))
        # The target exactly as measured: :g keeps 6 digits (scale=102400 for 3276799 tokens over 32).
        short = f"{choice.scale:g}"
        target = (f"max_length={args.max_length}" if args.max_length is not None
                  else f"scale={short if float(short) == choice.scale else repr(choice.scale)}")  # fmt: skip
        print(choice.table())
        print(f"\nbest: {choice.chosen}\n  patch_model(model, {target}, method={choice.method!r}{params})")
    return 0
