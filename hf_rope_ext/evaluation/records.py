"""The results file ``results.jsonl``: its record schema, its one reader and the resumable store.

This module is the bottom of the evaluation package: it imports neither torch nor the other
evaluation modules, so readers of results (reports, model cards, example scripts) stay light.

One JSON object per finished case, appended (and flushed to disk) as soon as the case ends, so an
interrupted run loses at most the case it was in, and a rerun of the same command skips every case
already in the file. A case is identified by the fields listed in :data:`IDENTITY_FIELDS` for its
kind; everything else is a result.

Schema (``scale`` is ``null`` for ``method: "none"``, the unpatched model)::

    {"kind": "perplexity", "mode": "buckets" | "sliding", "method": "yarn", "scale": 4.0,
     "steps_per_doubling": null,       # length-dependent methods: n of the patch, or "exact"
     "model": "HuggingFaceTB/SmolLM2-135M-Instruct", "dtype": "fp32", "document": "pg84",
     "model_fingerprint": "...",       # config and a sample of the weights (runner.model_fingerprint())
     "document_sha256": "...",         # the document's token ids (documents.document_hash())
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
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

from ..files import atomic_write_text, file_in_the_way

logger = logging.getLogger(__name__)

__all__ = [
    "EvaluationError",
    "append_record",
    "ResultStore",
    "case_key",
    "check_output_dir",
    "check_record",
    "check_same_model",
    "check_script_results",
    "check_stored_fields",
    "load_records",
    "parse_steps_per_doubling",
    "read_records",
    "read_results",
    "recorded_steps",
    "records_without_cut_line",
]

RESULTS_FILE = "results.jsonl"
# One name per dtype in the records, the command line's (--dtype): torch's names read as these.
DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
NONE_METHOD = "none"
EXACT_STEPS = "exact"  # steps_per_doubling=None in patch_model: frequencies of the exact length

IDENTITY_FIELDS = {
    "perplexity": ("kind", "mode", "method", "scale", "steps_per_doubling", "model", "model_fingerprint", "dtype",
                   "document", "document_sha256", "context_length", "stride", "eval_tokens", "bucket_size"),
    "retrieval": ("kind", "task", "method", "scale", "steps_per_doubling", "model", "model_fingerprint", "dtype",
                  "length", "depth", "trials", "seed", "needle_count", "max_new_tokens"),
}  # fmt: skip
# Fields that say which model state produced a case; the rest must match for a reuse.
STATE_FIELDS = ("method", "scale", "steps_per_doubling")


class EvaluationError(ValueError):
    """Bad input to an evaluation run (the message says what to change)."""


def is_length_dependent(method: str) -> bool:
    """Whether a registered method recomputes its frequencies from the input length."""
    from ..methods import get_method  # methods imports torch; only this look-up needs it

    return get_method(method).length_dependent


def recorded_steps(method: str, steps_per_doubling: int | None) -> int | str | None:
    """The ``steps_per_doubling`` field of a record: the patch's ``n`` for length-dependent
    methods (``"exact"`` for None), None for static methods and the unpatched model.

    Part of a case's identity, so that results of one frequency grid are never taken for
    another's (records written before the field existed have it missing, so never match).
    """
    if method == NONE_METHOD or not is_length_dependent(method):
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


def case_key(record: Mapping[str, Any]) -> str:
    """The identity of a case, as a string (the identity fields of its kind)."""
    kind = record.get("kind")
    if kind not in IDENTITY_FIELDS:
        raise EvaluationError(f"Unknown result kind {kind!r}; expected one of {sorted(IDENTITY_FIELDS)}.")
    return json.dumps({name: _identity_value(record.get(name)) for name in IDENTITY_FIELDS[kind]}, sort_keys=True)


def _identity_value(value: Any) -> Any:
    # 2 and 2.0 (a scale or depth edited by hand) are the same case; JSON would spell them apart.
    return float(value) if _is_int(value) else value


def data_key(record: Mapping[str, Any]) -> str:
    """The identity without the model state, plus the RoPE fingerprint: equal keys, equal results."""
    fields = [name for name in IDENTITY_FIELDS[record["kind"]] if name not in STATE_FIELDS]
    identity = {name: record.get(name) for name in fields}
    return json.dumps({**identity, "rope": record.get("rope_fingerprint")}, sort_keys=True)


# ----------------------------------------------------------------------------------------------
# Checking a record
# ----------------------------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_stored_fields(records: list[Mapping[str, Any]], path: Path,
                        fields: Mapping[str, tuple[str, Callable[[Any], bool]]]) -> None:
    """Refuse a stored record whose ``fields`` (name: (what it holds, test)) a script's table reads
    do not hold what the table needs, in one line naming the file, the record and the field:
    before the model loads, not after the new forwards."""
    for number, record in enumerate(records, start=1):
        for field, (holds, valid) in fields.items():
            if not valid(record.get(field)):
                raise ValueError(f"{path}: record {number} has no {holds} (field {field!r}, got "
                                 f"{record.get(field)!r}); fix or remove that line, or use another --output-dir")


def _is_bucket(value: Any, context_length: Any) -> bool:
    """``[start, end, ppl]`` with ``0 <= start < end <= context_length`` and a perplexity > 0
    (NaN and infinity allowed: a broken model's; NaN also for a bucket with no token)."""
    return (isinstance(value, list) and len(value) == 3 and _is_int(value[0]) and _is_int(value[1])
            and 0 <= value[0] < value[1] and (not _is_int(context_length) or value[1] <= context_length)
            and _is_number(value[2]) and not value[2] <= 0)  # fmt: skip


def _agrees(value: float, expected: float) -> bool:
    """Equal within rounding; NaN agrees with NaN and infinity with infinity."""
    if math.isnan(value) or math.isnan(expected):
        return math.isnan(value) and math.isnan(expected)
    return math.isclose(value, expected, rel_tol=1e-6)


# Field -> (required, test, what it must be): the fields that the reports, summaries and model
# cards read. A hand-edited line that breaks one is refused with its line number when the file is
# read, instead of a traceback in whichever report reads it first (after the new cases ran).
_TEXT = (lambda value: isinstance(value, str) and bool(value), "a non-empty string")
_INT = (_is_int, "an integer")
_OPTIONAL_INT = (lambda value: value is None or _is_int(value), "an integer or null")
_OPTIONAL_TEXT = (lambda value: value is None or isinstance(value, str), "a string or null")
# A perplexity is > 0 and a mean loss >= 0 (NaN and infinity stay: a broken model or an fp16 overflow).
_PPL = (lambda value: value is None or (_is_number(value) and not value <= 0), "a number > 0 (or NaN/inf) or null")
_COMMON_FIELDS = {
    "method": (True, *_TEXT),
    "scale": (False, lambda value: value is None or (_is_number(value) and value > 0), "a number > 0 or null"),
    "steps_per_doubling": (False, lambda value: value is None or value == EXACT_STEPS or (_is_int(value) and value > 0),
                           f"a positive integer, '{EXACT_STEPS}' or null"),
    "model": (True, *_TEXT),  # a record without one would be filed under no model and left out of results.md
    "dtype": (False, *_OPTIONAL_TEXT),
    "native_context": (False, lambda value: value is None or (_is_int(value) and value > 0),
                       "a positive integer or null"),
    "rope_fingerprint": (False, *_OPTIONAL_TEXT),
    "seconds": (False, lambda value: value is None or _is_number(value), "a number or null"),
    "reused_from": (False, lambda value: value is None or (isinstance(value, dict) and isinstance(value.get("method"),
                                                                                              str)),
                    "null or an object with a 'method'"),
}  # fmt: skip
RECORD_FIELDS = {
    "perplexity": {
        "mode": (True, lambda value: value in ("buckets", "sliding"), "'buckets' or 'sliding'"),
        **_COMMON_FIELDS,
        "document": (True, *_TEXT),
        "context_length": (True, lambda value: _is_int(value) and value >= 2, "an integer >= 2"),
        "stride": (False, *_OPTIONAL_INT),
        "eval_tokens": (False, *_OPTIONAL_INT),
        "bucket_size": (False, *_OPTIONAL_INT),
        "ppl": (False, *_PPL),
        "nll": (True, lambda value: _is_number(value) and not value < 0, "a number >= 0 (or NaN/inf)"),
        "tokens": (True, lambda value: _is_int(value) and value >= 1, "an integer >= 1"),
        "windows": (False, *_OPTIONAL_INT),
    },
    "retrieval": {
        "task": (True, *_TEXT),
        **_COMMON_FIELDS,
        "length": (True, lambda value: _is_int(value) and value >= 2, "an integer >= 2"),
        "depth": (True, lambda value: _is_number(value) and 0 <= value <= 1, "a number between 0 and 1"),
        "seed": (False, *_OPTIONAL_INT),
        "needle_count": (False, *_OPTIONAL_INT),
        "max_new_tokens": (False, *_OPTIONAL_INT),
        # correct > trials is shown as "counts inconsistent" by the report, so only the types are checked
        "correct": (False, _is_int, "an integer"),
        "trials": (False, lambda value: _is_int(value) and value >= 1, "an integer >= 1"),
        "accuracy": (False, lambda value: value is None or _is_number(value), "a number or null"),
        "answers": (False, lambda value: value is None or isinstance(value, list), "a list or null"),
        "outputs": (False, lambda value: value is None or isinstance(value, list), "a list or null"),
    },
}


def check_record(record: Mapping[str, Any], *, complete: bool = True) -> None:
    """Raise ``ValueError`` naming the first field of ``record`` that the readers could not read.

    ``complete``: every field the evaluation's reports need must be there; otherwise (model cards,
    which show what a hand-written record has) only the fields present are checked.
    """
    kind = record.get("kind")
    if kind not in RECORD_FIELDS:
        raise ValueError(f"field 'kind' must be one of {sorted(RECORD_FIELDS)}, got {kind!r}")
    for name, (required, test, expected) in RECORD_FIELDS[kind].items():
        if name not in record:
            if required and complete:
                raise ValueError(f"field {name!r} is missing (it must be {expected})")
        elif not test(record[name]):
            raise ValueError(f"field {name!r} must be {expected}, got {record[name]!r}")
    buckets = record.get("buckets")
    if kind == "perplexity" and buckets is None and complete and record["mode"] == "buckets":
        raise ValueError("field 'buckets' is missing (a list of [start, end, ppl] in buckets mode)")
    if kind == "perplexity" and buckets is not None:
        length = record.get("context_length")
        if not isinstance(buckets, list) or not all(_is_bucket(bucket, length) for bucket in buckets):
            bad = next((bucket for bucket in buckets if not _is_bucket(bucket, length)), buckets) \
                if isinstance(buckets, list) else buckets
            raise ValueError(f"field 'buckets' must be a list of [start, end, ppl] with 0 <= start < end <= "
                             f"context_length ({length}) and ppl > 0, got {bad!r}")  # fmt: skip
    if kind == "perplexity" and _is_number(record.get("ppl")) and _is_number(record.get("nll")):
        # The tables show exp(nll), results.csv the ppl field: they must be one number.
        nll = record["nll"]
        expected = nll if math.isnan(nll) else math.exp(nll) if nll < 709 else math.inf
        if not _agrees(record["ppl"], expected):
            raise ValueError(f"field 'ppl' is {record['ppl']!r}, but exp(nll) is {expected!r} (nll {record['nll']!r}); "
                             "they must agree")
    if kind == "retrieval" and all(_is_number(record.get(name)) for name in ("accuracy", "correct", "trials")):
        # results.md counts correct/trials, results.csv shows accuracy: they must be one number.
        expected = record["correct"] / record["trials"]
        if not math.isclose(record["accuracy"], expected, abs_tol=0.005):  # an accuracy rounded to a percent
            raise ValueError(f"field 'accuracy' is {record['accuracy']!r}, but correct/trials is "
                             f"{record['correct']}/{record['trials']}; they must agree")
    if kind == "retrieval" and complete:
        # Without both counts the report pools the accuracy (records written by hand).
        if ("correct" in record) != ("trials" in record):
            missing = "trials" if "correct" in record else "correct"
            raise ValueError(f"field {missing!r} is missing (give 'correct' and 'trials' together)")
        if "trials" not in record and not _is_number(record.get("accuracy")):
            raise ValueError("fields 'correct' and 'trials' are missing (or give a numeric 'accuracy')")


# The reports write_reports regenerates from results.jsonl (retrieval plots: one per task).
REPORT_FILES = ("summary.json", "results.csv", "results.md", "perplexity_by_position.png", "perplexity_vs_length.png",
                "retrieval_passkey.png", "retrieval_needle.png")  # fmt: skip


def _links_to_a_file_to_make(path: Path) -> bool:
    """Whether ``path`` is a symbolic link whose target, not made yet, can be created (a link that
    loops never resolves: realpath stops in the loop)."""
    try:
        target = Path(os.path.realpath(path, strict=False))
    except (OSError, ValueError):
        return False
    return not os.path.lexists(target) and target.parent.is_dir()


def check_output_dir(output_dir: str | os.PathLike, *, append: bool = True, reports: bool = True) -> None:
    """Refuse, before any work (the model loads, the first forward), an output folder that the
    evaluation could not write: a file; a broken symbolic link (the folder, a folder above it, or a
    ``results.jsonl`` whose target could not be made); a folder (or the folder it would be created
    in) that is not writable; a ``results.jsonl`` that is not a file or (``append``) cannot be
    appended to. With ``reports`` (a caller that writes eval's reports), also a folder where a
    report goes, and a folder holding files named as the reports but no ``results.jsonl``: they
    are not reports of an earlier evaluation, and would be overwritten. Without ``append`` and
    ``reports`` (a caller that writes neither), ``results.jsonl`` is not looked at."""
    output_dir = Path(output_dir)
    results = output_dir / RESULTS_FILE
    uses_results = append or reports  # a caller that writes neither (benchmark_speed.py) never opens it
    # A symbolic link to nothing passes exists() as "not there yet", and fails only at the first
    # write (mkdir: File exists; open: No such file), after the model loaded and a case ran. A
    # results.jsonl linked to a file not made yet is fine where that file can be made (append does).
    for entry in ((results,) if uses_results else ()) + (output_dir, *output_dir.parents):
        if entry == results and _links_to_a_file_to_make(results):
            continue
        if os.path.lexists(entry) and not entry.exists():
            what = f"--output-dir {output_dir} cannot be used: {entry}" if entry != results else str(results)
            raise EvaluationError(f"{what} is a broken symbolic link (to {os.readlink(entry)}); remove it or create "
                                  "its target, or use another --output-dir.")  # fmt: skip
    if output_dir.exists() and not output_dir.is_dir():
        raise EvaluationError(f"--output-dir {output_dir} is a file, not a folder; pass a folder (new or existing).")
    blocking = file_in_the_way(output_dir.parent)
    if blocking is not None:  # the folder could be made only at the first write, after a case ran
        raise EvaluationError(f"--output-dir {output_dir} cannot be created: {blocking} is a file; pass another folder.")
    if uses_results and results.exists() and not results.is_file():
        raise EvaluationError(f"{results} is not a file; remove it or use another --output-dir.")
    # os.access also sees a read-only file system and immutable files (chattr +i), for root too.
    existing = next(folder for folder in (output_dir, *output_dir.absolute().parents) if folder.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == output_dir else f" ({existing}, where it would be created)"
        raise EvaluationError(f"--output-dir {output_dir} is not writable for you{where}; results.jsonl and the "
                              "reports go there: make it writable (chmod u+w) or use another --output-dir.")
    if append and results.is_file() and not os.access(results, os.W_OK):
        raise EvaluationError(f"{results} is not writable for you, so no finished case could be kept; make it "
                              "writable (chmod u+w) or use another --output-dir.")  # fmt: skip
    if not reports:
        return
    report_paths = [output_dir / name for name in REPORT_FILES]
    for path in report_paths:
        if path.is_dir():
            raise EvaluationError(f"{path} is a folder, where the report {path.name} is written; move it, or use "
                                  "another --output-dir.")  # fmt: skip
    if not results.exists():
        found = [path.name for path in report_paths if os.path.lexists(path)]
        if found:
            raise EvaluationError(
                f"--output-dir {output_dir} holds {', '.join(found)} but no {RESULTS_FILE}, so not the reports of an "
                "earlier evaluation, and they would be overwritten; move them, or use another --output-dir."
            )


def check_same_model(records: list[Mapping[str, Any]], path: str | os.PathLike, model: str, dtype: str,
                     fingerprint: str) -> None:
    """Refuse the results of an example script made with another model (its own records name it by
    ``model``, ``dtype`` and ``model_fingerprint``), as the evaluation refuses them: they would be
    taken as done and shown for this model. Fingerprints differ between dtypes (the weights are
    sampled as they are stored), so they are compared within a dtype."""
    for record in records:
        if "model_fingerprint" not in record or not isinstance(record.get("model"), str):
            raise EvaluationError(
                f"{path} holds results written before the model was recorded with them, so they may be another "
                "model's; use another --output-dir."
            )
        if record["model"] != model:
            raise EvaluationError(
                f"{path} holds results of {record['model']!r}, not {model!r}; use another --output-dir for this model."
            )
        if record.get("dtype", "fp32") == dtype and record["model_fingerprint"] != fingerprint:
            raise EvaluationError(
                f"{path} holds results of a model named {model!r} ({dtype}) whose config or weights differ from the "
                f"model loaded now (fingerprint {record['model_fingerprint']} against {fingerprint}). Use another "
                "--output-dir for this model."
            )


# ----------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------


def load_records(path: str | os.PathLike, *, require_kind: bool = False) -> tuple[list[dict[str, Any]], int | None]:
    """``(records, skipped)``: the JSON objects of a results file, one per line, and the number of
    the line that was skipped as cut off (None if none was).

    Every append writes a whole line ending in a newline, so an interrupted one (Ctrl-C, a killed
    job, a full disk) leaves at most a last line without its newline: that line, if it is not
    valid JSON, is skipped with a warning naming it. Any other line that is not a JSON object, or
    whose record :func:`check_record` refuses (every record, complete, with ``require_kind``;
    otherwise the fields present of records of a known kind), raises :class:`EvaluationError`
    naming the file and line. Blank lines are ignored; a missing file has no records.
    """
    path = Path(path)
    if not path.exists():
        return [], None
    if not path.is_file():
        raise EvaluationError(f"{path} is not a file; remove it or use another folder.")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise EvaluationError(
            f"{path} is not UTF-8 text (byte {error.start}); it is not a results file: fix it or use another folder."
        ) from None
    lines = text.splitlines()
    records: list[dict[str, Any]] = []
    first_content: dict[tuple, tuple[Any, int]] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines) and not text.endswith("\n"):
                logger.warning("%s:%d is incomplete (an interrupted write) and is skipped; the evaluation computes "
                               "that case again.", path, number)  # fmt: skip
                return records, number
            raise EvaluationError(
                f"{path}:{number} is not valid JSON ({error.msg}); fix or remove that line, or use another folder."
            ) from None
        if not isinstance(record, dict):
            raise EvaluationError(
                f"{path}:{number} holds a JSON {type(record).__name__}, not an object; fix or remove that line."
            )
        if require_kind and "kind" not in record and "config" in record:  # compare_*.py write {"config": ...}
            raise EvaluationError(
                f"{path} holds results of compare_configurations.py or compare_retrieval.py, not of hf-rope-ext "
                "eval; use another --output-dir (those scripts rewrite their own table.md)."
            )
        # Other readers (model cards) take hand-written records with fields left out: check what is there.
        if require_kind or record.get("kind") in RECORD_FIELDS:
            try:
                check_record(record, complete=require_kind)
            except ValueError as error:
                raise EvaluationError(f"{path}:{number}: {error}; fix or remove that line.") from None
        if record.get("dtype") in DTYPE_NAMES:  # torch's name, as run_evaluation wrote it before
            record["dtype"] = DTYPE_NAMES[record["dtype"]]
        if require_kind:
            _check_one_content_per_name(record, path, number, first_content)
        records.append(record)
    return records, None


def _check_one_content_per_name(record: Mapping[str, Any], path: Path, number: int,
                                first_content: dict[tuple, tuple[Any, int]]) -> None:
    """Refuse a record that names a document or model (of one dtype) already named with other
    content on an earlier line (``first_content``: name -> (content hash, line), filled here), as
    the evaluation refuses to write one: the reports would pool two texts or two checkpoints."""
    names = [(("model", record.get("model"), record.get("dtype")), "model_fingerprint", "model")]
    if record.get("kind") == "perplexity":
        names.append((("document", record.get("document")), "document_sha256", "document"))
    for key, field, what in names:
        content = record.get(field)
        first = first_content.setdefault(key, (content, number))
        if first[0] != content:
            raise EvaluationError(
                f"{path}:{number}: field {field!r} is {content!r}, but line {first[1]} names {what} {key[1]!r} with "
                f"{first[0]!r}: two {what}s under one name are never pooled; remove the lines of one, or evaluate "
                "it into another --output-dir."
            )


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a results file (see :func:`load_records`): the one reader of ``results.jsonl``
    for the evaluation, its reports and model cards, and scripts that keep their own results."""
    return load_records(path)[0]


def records_without_cut_line(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a JSON-lines file that a script appends to (:func:`load_records`); a last line
    cut off by an interrupted write is dropped from the file too, so that the next append does not
    leave it inside the file, where every later read would refuse it."""
    records, skipped = load_records(path)
    if skipped is not None:
        atomic_write_text(Path(path), "".join(json.dumps(record) + "\n" for record in records))
    return records


def append_record(path: str | os.PathLike, record: Mapping[str, Any]) -> None:
    """Append one JSON line and flush it to disk; never glue it onto a last line without its newline."""
    path = Path(path)
    fresh_line = not path.exists() or path.stat().st_size == 0 or path.read_bytes()[-1:] == b"\n"
    with path.open("a", encoding="utf-8") as handle:
        handle.write(("" if fresh_line else "\n") + json.dumps(record) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def check_script_results(records: list[Mapping[str, Any]], path: str | os.PathLike) -> None:
    """Refuse, in an example script's own results file, the records of ``hf-rope-ext eval`` (they
    have a ``kind``): the script would append records of its own schema that eval then refuses,
    and read eval's with the wrong fields."""
    if any("kind" in record for record in records):
        raise EvaluationError(f"{path} holds results of hf-rope-ext eval, not of this script; use another "
                              "--output-dir.")  # fmt: skip


def read_results(output_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of ``<output_dir>/results.jsonl`` (empty if there is none), each of a known kind."""
    return load_records(Path(output_dir) / RESULTS_FILE, require_kind=True)[0]


# ----------------------------------------------------------------------------------------------
# The store
# ----------------------------------------------------------------------------------------------


class ResultStore:
    """``results.jsonl``: read once, then appended one line per finished case."""

    def __init__(self, output_dir: str | os.PathLike):
        check_output_dir(output_dir)
        self.path = Path(output_dir) / RESULTS_FILE
        self.records, skipped = load_records(self.path, require_kind=True)
        if skipped is not None:
            # Drop the cut-off line before appending, so that it does not end up inside the file.
            atomic_write_text(self.path, "".join(json.dumps(record) + "\n" for record in self.records))
        self._by_key = {case_key(record): record for record in self.records}

    def __contains__(self, key: str) -> bool:
        return key in self._by_key

    def get(self, key: str) -> dict[str, Any] | None:
        """The stored record of a case, or None."""
        return self._by_key.get(key)

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
        self._by_key.setdefault(case_key(record), record)

    def _lacks_final_newline(self) -> bool:
        if not self.path.exists() or self.path.stat().st_size == 0:
            return False
        with open(self.path, "rb") as file:
            file.seek(-1, os.SEEK_END)
            return file.read(1) != b"\n"
