"""Run many methods x scales in one process: the model is loaded once and patched per case.

Results file: ``<output_dir>/results.jsonl``, one JSON object per finished case, appended (and
flushed to disk) as soon as the case ends, so an interrupted run loses at most the case it was
in, and a rerun of the same command skips every case already in the file. A case is identified by
the fields listed in :data:`IDENTITY_FIELDS` for its kind; everything else is a result.

Schema (``scale`` is ``null`` for ``method: "none"``, the unpatched model)::

    {"kind": "perplexity", "mode": "buckets" | "sliding", "method": "yarn", "scale": 4.0,
     "steps_per_doubling": null,       # length-dependent methods: n of the patch, or "exact"
     "model": "HuggingFaceTB/SmolLM2-135M-Instruct", "dtype": "fp32", "document": "pg84",
     "model_fingerprint": "...",       # config and a sample of the weights (model_fingerprint())
     "document_sha256": "...",         # the document's token ids (document_hash())
     "context_length": 16384,          # L: tokens per forward (window length for "sliding")
     "stride": null | 256,             # S, sliding mode only
     "eval_tokens": null | 32768,      # sliding mode: first N tokens of the document scored
     "bucket_size": 2048 | null,       # buckets mode only
     "buckets": [[0, 2048, 13.1], ...] | null,   # [start, end, ppl] per position bucket
     "ppl": 11.2, "nll": 2.416, "tokens": 16383, "windows": 1,
     "native_context": 8192, "rope_fingerprint": "...", "seconds": 151.2,
     "reused_from": null | {"method": "none", "scale": null, "steps_per_doubling": null}}

    {"kind": "retrieval", "task": "passkey" | "needle", "method": "yarn", "scale": 4.0,
     "steps_per_doubling": null, "model": "...", "dtype": "fp32", "model_fingerprint": "...",
     "length": 16384,                  # prompt + answer budget: prompts have length - max_new_tokens tokens
     "depth": 0.5, "trials": 5, "seed": 0,
     "needle_count": null | 4, "max_new_tokens": 8,
     "correct": 4, "accuracy": 0.8, "answers": ["12345", ...], "outputs": [" 12345. The", ...],
     "native_context": 8192, "rope_fingerprint": "...", "seconds": 402.0, "reused_from": null}

Documents are identified by their content (``document_sha256``) and the model by its config and
weights (``model_fingerprint``), not by names alone: a folder whose records name the same
document or model with other content is refused, so numbers of one text or checkpoint are never
reported for another. Records written before these fields existed are refused the same way.

``steps_per_doubling`` is part of a case's identity: results of one frequency grid of the
length-dependent methods are never taken for another's. A record without the field (written
before it was recorded) matches no case of a length-dependent method; its numbers can still be
reused through its RoPE fingerprint.

Definitions of the numbers: :mod:`hf_rope_ext.evaluation.perplexity` and
:mod:`hf_rope_ext.evaluation.retrieval`.

Identical cases are computed once: when a case would use exactly the rotary frequencies of a
finished case with the same data (for instance ``dynamic-yarn`` at any length inside the native
context, which is the unpatched model, or ``dynamic-yarn`` at scales 2 and 4, whose frequencies
follow the input length only), its numbers are copied and ``reused_from`` names the source.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from .. import get_method, list_methods, patch_model, unpatch_model
from ..files import atomic_write_text
from ..patching import DEFAULT_STEPS_PER_DOUBLING
from ..rotary import ExtendedRotaryEmbedding
from .perplexity import DEFAULT_CHUNK_SIZE, bucket_perplexity, sliding_window_perplexity
from .retrieval import TASKS, retrieval_accuracy

logger = logging.getLogger(__name__)

__all__ = ["EvalPlan", "EvaluationError", "ResultStore", "run_evaluation", "case_key"]

RESULTS_FILE = "results.jsonl"
NONE_METHOD = "none"
PPL_MODES = ("buckets", "sliding")

IDENTITY_FIELDS = {
    "perplexity": ("kind", "mode", "method", "scale", "steps_per_doubling", "model", "model_fingerprint", "dtype",
                   "document", "document_sha256", "context_length", "stride", "eval_tokens", "bucket_size"),
    "retrieval": ("kind", "task", "method", "scale", "steps_per_doubling", "model", "model_fingerprint", "dtype",
                  "length", "depth", "trials", "seed", "needle_count", "max_new_tokens"),
}  # fmt: skip
# Fields that say which model state produced a case; the rest must match for a reuse.
_STATE_FIELDS = ("method", "scale", "steps_per_doubling")
EXACT_STEPS = "exact"  # steps_per_doubling=None in patch_model: frequencies of the exact length


def recorded_steps(method: str, steps_per_doubling: int | None) -> int | str | None:
    """The ``steps_per_doubling`` field of a record: the patch's ``n`` for length-dependent
    methods (``"exact"`` for None), None for static methods and the unpatched model.

    Part of a case's identity, so that results of one frequency grid are never taken for
    another's (records written before the field existed have it missing, so never match).
    """
    if method == NONE_METHOD or not get_method(method).length_dependent:
        return None
    return EXACT_STEPS if steps_per_doubling is None else int(steps_per_doubling)


def parse_steps_per_doubling(text: str) -> int | None:
    """Command-line form of ``steps_per_doubling``: a positive integer, or ``exact`` (None)."""
    if text.strip().lower() == EXACT_STEPS:
        return None
    try:
        steps = int(text)
    except ValueError:
        steps = 0
    if steps < 1:
        raise ValueError(f"steps per doubling must be a positive integer or '{EXACT_STEPS}', got {text!r}.")
    return steps


class EvaluationError(ValueError):
    """Bad input to an evaluation run (the message says what to change)."""


def case_key(record: Mapping[str, Any]) -> str:
    """The identity of a case, as a string (the identity fields of its kind)."""
    kind = record.get("kind")
    if kind not in IDENTITY_FIELDS:
        raise EvaluationError(f"Unknown result kind {kind!r}; expected one of {sorted(IDENTITY_FIELDS)}.")
    return json.dumps({name: record.get(name) for name in IDENTITY_FIELDS[kind]}, sort_keys=True)


def _data_key(record: Mapping[str, Any]) -> str:
    """The identity without the model state, plus the RoPE fingerprint: equal keys, equal results."""
    fields = [name for name in IDENTITY_FIELDS[record["kind"]] if name not in _STATE_FIELDS]
    identity = {name: record.get(name) for name in fields}
    return json.dumps({**identity, "rope": record.get("rope_fingerprint")}, sort_keys=True)


# ----------------------------------------------------------------------------------------------
# Results file
# ----------------------------------------------------------------------------------------------


class ResultStore:
    """``results.jsonl``: read once, then appended one line per finished case."""

    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir) / RESULTS_FILE
        self.records: list[dict[str, Any]] = self._load()
        self._keys = {case_key(record) for record in self.records}

    def _load(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        lines = self.path.read_text(encoding="utf-8").splitlines()
        records = []
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                if number == len(lines):
                    # An interrupted append leaves at most one partial last line: drop it.
                    logger.warning("%s: dropping an incomplete last line (an interrupted write).", self.path)
                    atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in records))
                    break
                raise EvaluationError(
                    f"{self.path}, line {number}, is not valid JSON; fix or remove that line, or use another "
                    "--output-dir."
                ) from None
        for record in records:
            case_key(record)  # raises on records of an unknown kind
        return records

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def append(self, record: dict[str, Any]) -> None:
        line = json.dumps(record) + "\n"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self._lacks_final_newline():  # e.g. edited by hand: never glue a record onto the last line
            line = "\n" + line
        with open(self.path, "a", encoding="utf-8") as file:
            file.write(line)
            file.flush()
            os.fsync(file.fileno())
        self.records.append(record)
        self._keys.add(case_key(record))


    def _lacks_final_newline(self) -> bool:
        if not self.path.exists() or self.path.stat().st_size == 0:
            return False
        with open(self.path, "rb") as file:
            file.seek(-1, os.SEEK_END)
            return file.read(1) != b"\n"


def read_results(output_dir: str | Path) -> list[dict[str, Any]]:
    """All records of ``<output_dir>/results.jsonl`` (empty if there is none)."""
    return ResultStore(output_dir).records


# ----------------------------------------------------------------------------------------------
# The plan
# ----------------------------------------------------------------------------------------------


@dataclass
class EvalPlan:
    """What to evaluate. Every list may be empty except ``methods``.

    Attributes:
        methods: registered method names, or ``"none"`` for the unpatched model.
        scales: scales applied to every method except ``"none"``.
        ppl_lengths: context lengths ``L`` for perplexity (one case per length and document).
        ppl_modes: ``"buckets"`` (one forward of ``L`` tokens) and/or ``"sliding"``.
        bucket_size: width of the position buckets (default: a quarter of the native context).
        stride: ``S`` of sliding-window perplexity.
        sliding_tokens: ``N``, document tokens scored by sliding windows (default: the longest
            of ``ppl_lengths``, so the longest window is a single forward).
        retrieval_tasks: ``"passkey"`` and/or ``"needle"``.
        retrieval_lengths: total tokens of prompt plus answer.
        depths: where the asked-for key goes, as a fraction of the filler.
        trials: prompts per (length, depth), with seeded random keys.
        needle_count: keys in a needle prompt (one asked for, the rest distractors).
        max_new_tokens: greedy decoding budget for an answer.
        seed: seed of the keys; the same prompts for every method.
        chunk_size: positions per LM-head call in the loss.
        reuse_identical: copy a case's numbers from a finished case with the same rotary
            frequencies instead of computing them again.
        steps_per_doubling: passed to :func:`hf_rope_ext.patch_model` for length-dependent
            methods (None: the exact length); recorded with every case.
    """

    methods: list[str]
    scales: list[float] = field(default_factory=list)
    ppl_lengths: list[int] = field(default_factory=list)
    ppl_modes: list[str] = field(default_factory=lambda: ["buckets"])
    bucket_size: int | None = None
    stride: int = 256
    sliding_tokens: int | None = None
    retrieval_tasks: list[str] = field(default_factory=list)
    retrieval_lengths: list[int] = field(default_factory=list)
    depths: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])
    trials: int = 3
    needle_count: int = 4
    max_new_tokens: int = 8
    seed: int = 0
    chunk_size: int = DEFAULT_CHUNK_SIZE
    reuse_identical: bool = True
    steps_per_doubling: int | None = DEFAULT_STEPS_PER_DOUBLING

    def configurations(self) -> list[tuple[str, float | None]]:
        """``(method, scale)`` pairs in run order: ``none`` first (scale ``None``)."""
        pairs: list[tuple[str, float | None]] = []
        if NONE_METHOD in self.methods:
            pairs.append((NONE_METHOD, None))
        for method in self.methods:
            if method != NONE_METHOD:
                pairs += [(method, float(scale)) for scale in self.scales]
        return pairs

    def validate(self, native_context: int | None) -> None:
        """Raise :class:`EvaluationError` naming the problem and the fix.

        ``native_context`` None skips the one check that needs the model (lengths against its
        native context), so a plan can be checked before the model is loaded.
        """
        if not self.methods:
            raise EvaluationError("No methods given; use e.g. --methods none,yarn,dynamic-yarn.")
        known = list(list_methods())
        # a "+logn" suffix adds log-n attention to any method (see patch_model)
        unknown = [method for method in self.methods if method != NONE_METHOD and method.removesuffix("+logn") not in known]
        if unknown:
            raise EvaluationError(
                f"Unknown method(s) {', '.join(map(repr, unknown))}. Known: {NONE_METHOD} (the unpatched model), "
                f"{', '.join(known)}, each optionally with '+logn'."
            )
        steps = self.steps_per_doubling
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise EvaluationError(
                f"steps_per_doubling must be a positive integer or None (exact length), got {steps!r}."
            )
        if len(set(self.methods)) != len(self.methods):
            raise EvaluationError(f"A method is listed twice in {self.methods}.")
        scaled = [method for method in self.methods if method != NONE_METHOD]
        if scaled and not self.scales:
            raise EvaluationError(f"Methods {scaled} need at least one scale; use e.g. --scales 2,4.")
        for scale in self.scales:
            if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 1:
                raise EvaluationError(f"Scales must be numbers > 1 (times the native context), got {scale!r}.")
        for name in ("ppl_lengths", "retrieval_lengths"):
            for length in getattr(self, name):
                if isinstance(length, bool) or not isinstance(length, int) or length < 2:
                    raise EvaluationError(f"{name} must be positive integer token counts, got {length!r}.")
        unknown_modes = [mode for mode in self.ppl_modes if mode not in PPL_MODES]
        if unknown_modes:
            raise EvaluationError(f"Unknown perplexity mode(s) {unknown_modes}; use {' and/or '.join(PPL_MODES)}.")
        unknown_tasks = [task for task in self.retrieval_tasks if task not in TASKS]
        if unknown_tasks:
            raise EvaluationError(f"Unknown retrieval task(s) {unknown_tasks}; use {' and/or '.join(TASKS)}.")
        if self.retrieval_tasks and not self.retrieval_lengths:
            raise EvaluationError("Retrieval tasks need --retrieval-lengths (e.g. 8192,16384).")
        if self.ppl_lengths and not self.ppl_modes:
            raise EvaluationError("Perplexity lengths were given but no --ppl-modes.")
        if not self.ppl_lengths and not (self.retrieval_tasks and self.retrieval_lengths):
            raise EvaluationError(
                "Nothing to evaluate: give --ppl-lengths and/or --retrieval-tasks with --retrieval-lengths."
            )
        for depth in self.depths:
            if not 0.0 <= depth <= 1.0:
                raise EvaluationError(f"Depths are fractions of the prompt between 0 and 1, got {depth}.")
        if self.retrieval_tasks and not self.depths:
            raise EvaluationError("Retrieval needs at least one depth (e.g. --depths 0.1,0.5,0.9).")
        for name in ("trials", "max_new_tokens", "stride", "chunk_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EvaluationError(f"{name} must be a positive integer, got {value!r}.")
        if "needle" in self.retrieval_tasks and not 2 <= self.needle_count <= 20:
            raise EvaluationError(f"needle_count must be between 2 and 20, got {self.needle_count}.")
        if self.bucket_size is not None and self.bucket_size < 1:
            raise EvaluationError(f"bucket_size must be a positive number of tokens, got {self.bucket_size}.")
        if "sliding" in self.ppl_modes and self.ppl_lengths:
            if self.stride > min(self.ppl_lengths):
                raise EvaluationError(
                    f"stride {self.stride} is longer than the shortest window {min(self.ppl_lengths)}."
                )
            if self.sliding_tokens is not None and self.sliding_tokens < max(self.ppl_lengths):
                raise EvaluationError(
                    f"sliding_tokens={self.sliding_tokens} is shorter than the longest window {max(self.ppl_lengths)}; "
                    "the windows must fit in the scored span."
                )
        lengths = self.ppl_lengths + self.retrieval_lengths
        if scaled and lengths and native_context is not None and max(lengths) <= native_context:
            raise EvaluationError(
                f"Every requested length ({', '.join(map(str, sorted(set(lengths))))}) is within the model's own "
                f"context of {native_context} tokens, so the scaling methods are not compared where they matter. "
                f"Add a length above {native_context} (e.g. {2 * native_context})."
            )
        if self.retrieval_tasks:
            shortest = min(self.retrieval_lengths) - self.max_new_tokens
            if shortest < 128:
                raise EvaluationError(
                    f"Retrieval length {min(self.retrieval_lengths)} leaves {shortest} prompt tokens; use at least "
                    f"{128 + self.max_new_tokens}."
                )

    def required_document_tokens(self) -> int:
        """How many tokens every document needs."""
        needed = max(self.ppl_lengths, default=0) if "buckets" in self.ppl_modes else 0
        if "sliding" in self.ppl_modes and self.ppl_lengths:
            needed = max(needed, self.sliding_tokens or max(self.ppl_lengths))
        return needed


# ----------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------


def document_hash(ids: torch.Tensor) -> str:
    """SHA-256 of a document's token ids (so also of the tokenizer that made them), 16 hex digits."""
    return hashlib.sha256(ids.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()).hexdigest()[:16]


# Config keys that do not change what the model computes.
_CONFIG_KEYS_IGNORED = ("transformers_version", "dtype", "torch_dtype", "architectures")


def model_fingerprint(model: nn.Module, samples_per_tensor: int = 1024) -> str:
    """A short hash of the model's config and of its weights, 16 hex digits.

    The weights enter through every parameter's name and shape and ``samples_per_tensor``
    evenly spaced values (cheap even for large models; fine-tuned or other checkpoints differ
    there). Parameters offloaded to the meta device enter by name and shape only. Keys starting
    with ``_`` (name or path, attention implementation) are left out.
    """
    config = model.config.to_dict()
    described = {key: value for key, value in config.items()
                 if not key.startswith("_") and key not in _CONFIG_KEYS_IGNORED}  # fmt: skip
    digest = hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            digest.update(f"{name}{tuple(parameter.shape)}".encode())
            if parameter.device.type != "meta" and parameter.numel():
                flat = parameter.detach().reshape(-1)
                step = max(1, flat.numel() // samples_per_tensor)
                digest.update(flat[::step][:samples_per_tensor].to("cpu", torch.float64).numpy().tobytes())
    return digest.hexdigest()[:16]


def _check_same_inputs(store: ResultStore, model_name: str, dtype: str, fingerprint: str,
                       document_hashes: Mapping[str, str]) -> None:
    """Refuse a results folder whose records use the same names for another model or text."""
    for record in store.records:
        if record.get("model") == model_name and record.get("dtype") == dtype:
            if record.get("model_fingerprint") != fingerprint:
                raise EvaluationError(
                    f"{store.path} holds results of a model named {model_name!r} ({dtype}) whose config or weights "
                    f"differ from the model loaded now (fingerprint {record.get('model_fingerprint')} against "
                    f"{fingerprint}). Use another --output-dir for this model."
                )
        name = record.get("document")
        if record.get("kind") == "perplexity" and name in document_hashes:
            if record.get("document_sha256") != document_hashes[name]:
                raise EvaluationError(
                    f"{store.path} holds results for a document named {name!r} with other content (token hash "
                    f"{record.get('document_sha256')} against {document_hashes[name]} now). Rename the file, or use "
                    "another --output-dir."
                )


def rope_fingerprint(model: nn.Module, length: int) -> str:
    """A short hash of the rotary frequencies ``model`` uses for a ``length``-token input.

    ``"original"`` for the model's own RoPE: unpatched, or a length-dependent or attention-level
    method inside the native context (where it calls the original module). Attention-level
    methods and log-n attention add their position remap and temperature to the hash.
    """
    rotary = next((module for module in model.modules() if isinstance(module, ExtendedRotaryEmbedding)), None)
    inside = rotary is not None and length <= rotary.original_max_seq_len
    if rotary is None or (inside and rotary.original_inside_context):
        return "original"
    inv_freq, attention_factor = rotary.frequencies(length)
    attention = rotary.attention_patch
    remap = "" if attention is None else f"{attention.remap!r} logn={attention.logn}"
    digest = hashlib.sha1(inv_freq.double().numpy().tobytes() + repr(float(attention_factor)).encode() + remap.encode())
    return digest.hexdigest()[:16]


@dataclass
class _Case:
    spec: dict[str, Any]  # identity fields
    label: str

    @property
    def key(self) -> str:
        return case_key(self.spec)


def _cases(plan: EvalPlan, method: str, scale: float | None, model_name: str, model_print: str, dtype: str,
           document_hashes: Mapping[str, str], native_context: int) -> list[_Case]:
    cases = []
    steps = recorded_steps(method, plan.steps_per_doubling)
    common = {"method": method, "scale": scale, "steps_per_doubling": steps, "model": model_name,
              "model_fingerprint": model_print, "dtype": dtype}  # fmt: skip
    state = method if scale is None else f"{method} x{scale:g}"
    if steps is not None:
        state += f" [steps_per_doubling={steps}]" if steps != EXACT_STEPS else " [exact length]"
    bucket_size = plan.bucket_size or max(native_context // 4, 1)
    for mode in plan.ppl_modes if plan.ppl_lengths else []:
        for length in plan.ppl_lengths:
            for name, content_hash in document_hashes.items():
                spec = {"kind": "perplexity", "mode": mode, **common, "document": name,
                        "document_sha256": content_hash, "context_length": length,
                        "stride": None, "eval_tokens": None, "bucket_size": None}  # fmt: skip
                if mode == "buckets":
                    spec["bucket_size"] = bucket_size
                else:
                    spec["stride"] = plan.stride
                    spec["eval_tokens"] = plan.sliding_tokens or max(plan.ppl_lengths)
                cases.append(_Case(spec, f"{state} ppl/{mode} {name} L={length}"))
    for task in plan.retrieval_tasks:
        for length in plan.retrieval_lengths:
            for depth in plan.depths:
                spec = {"kind": "retrieval", "task": task, **common, "length": length, "depth": float(depth),
                        "trials": plan.trials, "seed": plan.seed,
                        "needle_count": plan.needle_count if task == "needle" else None,
                        "max_new_tokens": plan.max_new_tokens}  # fmt: skip
                cases.append(_Case(spec, f"{state} {task} L={length} depth={depth:g}"))
    return cases


def _fingerprint_of(model: nn.Module, spec: Mapping[str, Any]) -> str:
    if spec["kind"] == "perplexity":
        return rope_fingerprint(model, spec["context_length"])
    prompt = spec["length"] - spec["max_new_tokens"]
    first, last = rope_fingerprint(model, prompt), rope_fingerprint(model, spec["length"])
    return first if first == last else f"{first}+{last}"


def _run_case(model: nn.Module, tokenizer, plan: EvalPlan, spec: dict[str, Any],
              documents: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    if spec["kind"] == "perplexity":
        document = documents[spec["document"]]
        if spec["mode"] == "buckets":
            result = bucket_perplexity(model, [document], spec["context_length"], bucket_size=spec["bucket_size"],
                                       chunk_size=plan.chunk_size)  # fmt: skip
            return {"buckets": [list(bucket) for bucket in result.bucket_ppls()], "ppl": result.ppl,
                    "nll": result.nll, "tokens": result.tokens, "windows": 1}  # fmt: skip
        result = sliding_window_perplexity(
            model, [document], spec["context_length"], stride=spec["stride"], max_tokens=spec["eval_tokens"],
            bos_token_id=getattr(tokenizer, "bos_token_id", None), chunk_size=plan.chunk_size,
        )
        return {"buckets": None, "ppl": result.ppl, "nll": result.nll, "tokens": result.tokens,
                "windows": result.windows}  # fmt: skip
    result = retrieval_accuracy(
        model, tokenizer, spec["task"], spec["length"], spec["depth"], trials=spec["trials"], seed=spec["seed"],
        needle_count=spec["needle_count"] or plan.needle_count, max_new_tokens=spec["max_new_tokens"],
    )
    return {"correct": result.correct, "accuracy": result.accuracy, "answers": result.answers,
            "outputs": result.outputs}  # fmt: skip


def check_documents(plan: EvalPlan, documents: Mapping[str, torch.Tensor],
                    length_flags: str = "--ppl-lengths / --sliding-tokens") -> None:
    """Every document must hold the tokens the plan needs (``length_flags``: the options that set
    those lengths, named in the error)."""
    needed = plan.required_document_tokens()
    if needed and not documents:
        raise EvaluationError("Perplexity needs at least one document: pass --text-file (or --dataset).")
    short = {name: len(ids) for name, ids in documents.items() if len(ids) < needed}
    if short:
        listing = ", ".join(f"{name} ({count} tokens)" for name, count in short.items())
        raise EvaluationError(
            f"Document(s) shorter than the {needed} tokens requested: {listing}. Use longer documents, or shorter "
            f"{length_flags}."
        )


def run_evaluation(
    model: nn.Module,
    tokenizer,
    plan: EvalPlan,
    output_dir: str | Path,
    *,
    documents: Mapping[str, torch.Tensor] | None = None,
    model_name: str | None = None,
    dtype: str | None = None,
    native_context: int | None = None,
    write_report: bool = True,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Evaluate every (method, scale) of ``plan`` on ``model``; returns the records of this plan.

    Cases already in ``<output_dir>/results.jsonl`` are skipped. The model is patched with
    :func:`hf_rope_ext.patch_model` for each configuration and restored with
    :func:`hf_rope_ext.unpatch_model` afterwards, also when a case fails or the run is
    interrupted. Reports (:func:`hf_rope_ext.evaluation.report.write_reports`) are rewritten at
    the end, also after an interruption.
    """
    documents = dict(documents or {})
    if native_context is None:
        native_context = int(model.config.max_position_embeddings)
    model_name = model_name or str(getattr(model.config, "_name_or_path", "") or type(model).__name__)
    dtype = dtype or str(next(model.parameters()).dtype).replace("torch.", "")
    plan.validate(native_context)
    check_documents(plan, documents)

    store = ResultStore(output_dir)
    document_hashes = {name: document_hash(ids) for name, ids in documents.items()}
    model_print = model_fingerprint(model)
    _check_same_inputs(store, model_name, dtype, model_print, document_hashes)
    logger.info("Cases are matched by content: documents by a hash of their tokens (%s), the model by its config and "
                "weights (fingerprint %s).", ", ".join(f"{name} {value}" for name, value in document_hashes.items())
                or "no documents", model_print)  # fmt: skip
    by_data_key = {_data_key(record): record for record in store.records if "rope_fingerprint" in record}
    groups = [(method, scale, _cases(plan, method, scale, model_name, model_print, dtype, document_hashes,
                                     native_context))
              for method, scale in plan.configurations()]  # fmt: skip
    planned = [case for _, _, cases in groups for case in cases]
    pending = sum(case.key not in store for case in planned)
    logger.info("%d cases planned, %d already in %s, %d to run.", len(planned), len(planned) - pending, store.path,
                pending)  # fmt: skip
    bar = tqdm(total=pending, desc="evaluation", unit="case", disable=not progress or pending == 0)
    try:
        for method, scale, cases in groups:
            todo = [case for case in cases if case.key not in store]
            if not todo:
                continue
            if method != NONE_METHOD:
                extra = {"steps_per_doubling": plan.steps_per_doubling} if get_method(method).length_dependent else {}
                patch_model(model, scale, method, original_max_length=native_context, **extra)
            try:
                for case in todo:
                    bar.set_postfix_str(case.label)
                    fingerprint = _fingerprint_of(model, case.spec)
                    record = {**case.spec, "native_context": native_context, "rope_fingerprint": fingerprint}
                    source = by_data_key.get(_data_key(record)) if plan.reuse_identical else None
                    if source is not None:
                        results = {key: value for key, value in source.items() if key not in record}
                        results["seconds"] = 0.0
                        origin = source.get("reused_from") or {name: source.get(name) for name in _STATE_FIELDS}
                        results["reused_from"] = origin
                        logger.info("%s: same rotary frequencies as %s x%s; numbers reused.", case.label,
                                    source["method"], source["scale"])  # fmt: skip
                    else:
                        started = time.perf_counter()
                        results = _run_case(model, tokenizer, plan, case.spec, documents)
                        results["seconds"] = round(time.perf_counter() - started, 2)
                        results["reused_from"] = None
                    record.update(results)
                    store.append(record)
                    by_data_key.setdefault(_data_key(record), record)
                    logger.info("%s: %s", case.label, _short_result(record))
                    bar.update(1)
            finally:
                if method != NONE_METHOD:
                    unpatch_model(model)
    finally:
        bar.close()
        if write_report and store.records:
            from .report import write_reports

            write_reports(output_dir)
    keys = {case.key for case in planned}
    return [record for record in store.records if case_key(record) in keys]


def _short_result(record: Mapping[str, Any]) -> str:
    if record["kind"] == "perplexity":
        return f"ppl {record['ppl']:.3f}"
    return f"{record['correct']}/{record['trials']} correct"


# ----------------------------------------------------------------------------------------------
# Documents
# ----------------------------------------------------------------------------------------------


def documents_from_files(tokenizer, paths: Iterable[str | Path]) -> dict[str, torch.Tensor]:
    """Token ids of text files, named by file stem (Project Gutenberg headers stripped)."""
    from ..data import read_text, tokenize

    documents: dict[str, torch.Tensor] = {}
    for path in map(Path, paths):
        name = path.stem
        if name in documents:
            raise EvaluationError(f"Two documents are named {name!r}; give files with different names.")
        documents[name] = tokenize(tokenizer, read_text(path))
        logger.info("%s: %d tokens", path, len(documents[name]))
    return documents


def documents_from_dataset(tokenizer, name: str, *, split: str = "test", text_field: str = "text",
                           config: str | None = None, count: int = 1, min_tokens: int = 0) -> dict[str, torch.Tensor]:
    """The first ``count`` texts of a ``datasets`` dataset with at least ``min_tokens`` tokens."""
    from ..data import iter_dataset_texts, tokenize

    documents: dict[str, torch.Tensor] = {}
    for index, text in enumerate(iter_dataset_texts(name, split=split, text_field=text_field, config=config)):
        ids = tokenize(tokenizer, text)
        if len(ids) >= min_tokens:
            documents[f"{name.rsplit('/', 1)[-1]}#{index}"] = ids
        if len(documents) >= count:
            break
    if len(documents) < count:
        raise EvaluationError(
            f"Dataset {name} ({split}) has only {len(documents)} text(s) of at least {min_tokens} tokens; "
            f"{count} requested."
        )
    return documents
