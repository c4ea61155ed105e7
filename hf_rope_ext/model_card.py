"""Model cards for patched checkpoints, built with huggingface_hub's ``ModelCard``/``ModelCardData``.

(Over 400 lines: the card's sections, the checks that its inputs belong to one checkpoint,
and the `card` command that writes it.)

A card says what was done (base model, method, scale, original and extended context), how to
load the checkpoint (transformers, vLLM, llama.cpp; from :func:`hf_rope_ext.hub.runtime_settings`),
how well it works (the evaluation tool's ``results.jsonl`` and plots) and how it was trained
(the fine-tuning run's ``training_summary.json``)::

    hf-rope-ext card --model-dir out/smollm2-yarn --eval-dir out/eval \\
        --training-summary out/train/training_summary.json --output out/smollm2-yarn/README.md

The layout lives in the Jinja template ``hf_rope_ext/templates/model_card.md``; the metadata the Hub
reads (``base_model``, ``library_name``, ``tags``, ``pipeline_tag``, ``model-index``) comes
from ``ModelCardData``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from . import config_io
from .config_io import RecordedPatch
from .evaluation.records import RESULTS_FILE, read_records, recorded_steps
from .evaluation.summary import format_accuracy, format_ppl, format_scale, format_tokens, method_label, retrieval_rows
from .files import atomic_path, atomic_write_text
from .spec import method_spec
from .validation import is_finite, is_real

logger = logging.getLogger(__name__)

__all__ = ["load_eval_results", "load_training_summary", "render_model_card", "write_model_card"]

DEFAULT_TEMPLATE = Path(__file__).resolve().parent / "templates" / "model_card.md"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_MISSING = "—"
# The card metadata entry naming the patch a card describes (read by hf_rope_ext.hub.save_patched).
CARD_PATCH_KEY = "hf_rope_ext"
# what the loading instructions name when no repo_id is given (push_patched_to_hub puts its repo id there)
CARD_PLACEHOLDER_REPO = "path/to/this/checkpoint"


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------


def load_eval_results(eval_dir: str | os.PathLike) -> tuple[list[dict[str, Any]], list[Path]]:
    """``(records, plots)`` from an evaluation folder: ``results.jsonl`` and its ``*.png`` files.

    Read as the evaluation reads it (:func:`hf_rope_ext.evaluation.records.read_records`): a last
    line cut off by an interrupted run is skipped with a warning; any other line that is not a
    JSON object raises ``ValueError`` naming the file and line.
    """
    folder = Path(eval_dir)
    path = folder / RESULTS_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"No {RESULTS_FILE} in {folder}; point --eval-dir at the evaluation tool's output folder."
        )
    plots, skipped = [], []
    for plot in sorted(folder.glob("*.png")):
        # A folder or a broken link named *.png would fail the copy, after the card's folder was made.
        (plots if plot.is_file() and os.access(plot, os.R_OK) else skipped).append(plot)
    if skipped:
        logger.warning("Leaving out of the card what is not a readable image file in %s: %s.", folder,
                       ", ".join(plot.name for plot in skipped))
    return read_records(path), plots


def load_training_summary(path: str | os.PathLike) -> dict[str, Any]:
    """The fine-tuning run's ``training_summary.json``."""
    path = Path(path)
    try:
        summary = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"Training summary {path} does not exist.") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error.msg} at line {error.lineno}).") from None
    if not isinstance(summary, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(summary).__name__}.")
    _check_training_summary(summary, path)
    return summary


def _check_training_summary(summary: Mapping[str, Any], source: Any) -> None:
    """Refuse a JSON object that is not a fine-tuning run's summary (a config.json, ``{}``, a
    ``rope_patch`` with no method or scale): the card would call the checkpoint fine-tuned and list
    its keys as training details. The values the card shows as numbers must be ones."""
    where = f"{source} " if isinstance(source, (str, os.PathLike)) else ""
    rope_patch = summary.get("rope_patch")
    if rope_patch is not None and not isinstance(rope_patch, Mapping):
        raise ValueError(f"The training summary {where}has a rope_patch that is not an object ({rope_patch!r}); pass "
                         "the training_summary.json that hf-rope-ext's fine-tuning wrote.")  # fmt: skip
    method, scale = _trained_method_and_scale(summary)
    if not isinstance(method, str) or not (is_finite(scale) and scale > 0):
        raise ValueError(
            f"The training summary {where}is not one: it has no method (a name) and scale (a positive number), in its "
            "rope_patch record or at the top level, which every training_summary.json of hf-rope-ext's fine-tuning "
            "has. Pass that file, or leave out --training-summary for a training-free checkpoint."
        )
    losses, target = summary.get("losses"), summary.get("target_length")
    problem = None
    if summary.get("final_loss") is not None and not is_finite(summary["final_loss"]):
        problem = f"final_loss {summary['final_loss']!r} is not a finite number"
    elif losses is not None and not (isinstance(losses, list) and all(is_finite(loss) for loss in losses)):
        problem = "losses is not a list of finite numbers"
    elif target is not None and not (is_finite(target) and target > 0 and float(target).is_integer()):
        problem = f"target_length {target!r} is not a positive number of tokens"
    if problem:
        raise ValueError(f"The training summary {where}is damaged: {problem}. Pass the training_summary.json that "
                         "hf-rope-ext's fine-tuning wrote, as it wrote it.")  # fmt: skip


def _trained_method_and_scale(summary: Mapping[str, Any]) -> tuple[Any, Any]:
    """The run's method name and scale: its ``rope_patch`` record's, else the top-level fields."""
    recorded = summary.get("rope_patch") if isinstance(summary.get("rope_patch"), Mapping) else {}
    method = recorded.get("method") if isinstance(recorded.get("method"), str) else summary.get("method")
    scale = recorded.get("scale") if recorded.get("scale") is not None else summary.get("scale")
    return method, scale


# ----------------------------------------------------------------------------------------------
# Formatting
# ----------------------------------------------------------------------------------------------


def _number(value: Any, digits: int = 2) -> str:
    if isinstance(value, bool) or value is None:
        return _MISSING if value is None else str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.{digits}f}"
    return str(value)


def _cell(text: Any) -> str:
    """Text for a markdown table cell: a ``|`` would end the cell, a line break the row."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _value(value: Any) -> str:
    if isinstance(value, Mapping):
        return ", ".join(f"{key}={_value(item)}" for key, item in value.items()) or _MISSING
    if isinstance(value, (list, tuple)):
        return ", ".join(_value(item) for item in value) or _MISSING
    if isinstance(value, float):
        return f"{value:.6g}"
    return _number(value)


def _method_of(record: Mapping[str, Any]) -> str:
    """The method of an evaluation record, with its frequency steps where they are not the default."""
    method = record.get("method")
    if not isinstance(method, str):
        return _MISSING
    return method_label(method, record.get("steps_per_doubling"))


def _parameters_eval_does_not_set(patch: RecordedPatch) -> list[str]:
    """The patch's parameters that differ from its method's defaults (``name=value``): evaluation
    records name the method and scale, not parameters, as ``hf-rope-ext eval`` applies methods with
    their defaults; a record of this method and scale is then not a result of this patch."""
    from .methods import REQUIRED, resolve_params

    method = patch.rope_method
    if any(value is REQUIRED for value in method.defaults.values()):  # longrope's factors: eval cannot give them
        return [f"{key}=..." for key, value in method.defaults.items() if value is REQUIRED]
    defaults = resolve_params(method, patch.rotary_dim, {})
    return [f"{key}={value!r}" for key, value in patch.params.items() if not _equal(value, defaults.get(key))]


def _same_patch(record: Mapping[str, Any], patch: RecordedPatch) -> bool:
    """Evaluated with this checkpoint's patch: method, scale and, for length-dependent methods,
    frequency steps (a record without them cannot be attributed to this checkpoint); never for a
    patch whose parameters are not its method's defaults (records do not name parameters)."""
    if _parameters_eval_does_not_set(patch):
        return False
    scale = record.get("scale")
    # The evaluation records the method as patch_model took it: "yarn+logn" is not plain "yarn".
    same = record.get("method") == patch.label and isinstance(scale, (int, float)) and math.isclose(
        float(scale), patch.scale
    )
    if same and patch.rope_method.length_dependent:
        same = record.get("steps_per_doubling") == recorded_steps(patch.method, patch.steps_per_doubling)
    return same


def _perplexity_tables(records: list[dict[str, Any]]) -> tuple[list[dict], list[str], list[dict]]:
    rows, bucket_rows = [], []
    bucket_ranges: dict[tuple[int, int], None] = {}
    for record in records:
        if record.get("kind") != "perplexity":
            continue
        if record.get("ppl") is None and not record.get("buckets"):
            logger.warning("Skipping a perplexity result without ppl or buckets: %s", record)
            continue
        common = {
            "method": _cell(_method_of(record)),
            "scale": _cell(format_scale(record.get("scale"), _MISSING)),
            "document": _cell(record.get("document", _MISSING)),
            "context": _cell(_number(record.get("context_length"))),
        }
        if record.get("ppl") is not None:
            rows.append({
                **common,
                "mode": _cell(record.get("mode", _MISSING)),
                "stride": _number(record.get("stride")),
                "ppl": format_ppl(record["ppl"], _MISSING),
                "_sort": (str(common["method"]), float(record.get("scale") or 0), record.get("context_length") or 0),
            })
        buckets = {}
        for bucket in record.get("buckets") or []:
            if isinstance(bucket, (list, tuple)) and len(bucket) == 3:
                start, end, value = bucket
                buckets[(int(start), int(end))] = value
                bucket_ranges[(int(start), int(end))] = None
        if buckets:
            bucket_rows.append({**common, "_buckets": buckets,
                                "_sort": (str(common["method"]), float(record.get("scale") or 0),
                                          record.get("context_length") or 0)})
    header_ranges = sorted(bucket_ranges)
    for row in bucket_rows:
        row["cells"] = [format_ppl(row["_buckets"].get(span), _MISSING) for span in header_ranges]
    header = [f"{format_tokens(start)}-{format_tokens(end)}" for start, end in header_ranges]
    rows.sort(key=lambda row: row["_sort"])
    bucket_rows.sort(key=lambda row: row["_sort"])
    return rows, header, bucket_rows


def _retrieval_table(records: list[dict[str, Any]]) -> list[dict]:
    """The evaluation summary's retrieval rows (trials pooled over depths), formatted for the card."""
    rows = []
    for row in retrieval_rows(records):
        if math.isnan(row["accuracy"]):
            continue
        method = _method_of(row)
        rows.append({
            "task": _cell(row["task"] if row["task"] is not None else _MISSING),
            "method": _cell(method),
            "scale": format_scale(row["scale"], _MISSING),
            "length": _number(row["length"]),
            "depths": ", ".join(row["by_depth"]) or _MISSING,
            "correct": f"{row['correct']}/{row['trials']}" if row["trials"] else _MISSING,
            "accuracy": format_accuracy(row["accuracy"]),
            "_accuracy": row["accuracy"],
            "_sort": (str(row["task"]), method, float(row["scale"] or 0), row["length"] or 0),
        })
    rows.sort(key=lambda row: row["_sort"])
    return rows


def _eval_results(records: list[dict[str, Any]], patch: RecordedPatch):
    """``EvalResult`` entries (the Hub's model-index) for this checkpoint's own rows."""
    from huggingface_hub import EvalResult

    results = []
    for record in records:
        if not _same_patch(record, patch):
            continue
        if record.get("kind") == "perplexity" and isinstance(record.get("ppl"), (int, float)):
            document = str(record.get("document", "text"))
            results.append(EvalResult(
                task_type="text-generation",
                task_name="Language modeling",
                dataset_type=document,
                dataset_name=document,
                metric_type="perplexity",
                metric_value=round(float(record["ppl"]), 4),
                metric_name=f"perplexity ({record.get('mode', 'forward')}, {record.get('context_length')} tokens)",
            ))
    for row in _retrieval_table([r for r in records if _same_patch(r, patch)]):
        results.append(EvalResult(
            task_type="text-generation",
            task_name=f"{row['task']} retrieval",
            dataset_type=str(row["task"]),
            dataset_name=f"{row['task']} retrieval",
            metric_type="accuracy",
            metric_value=round(row["_accuracy"], 4),
            metric_name=f"{row['task']} accuracy ({row['length']} tokens)",
        ))
    return results


_TRAINING_LABELS = {
    "base_model": "Base model",
    "method": "Method",
    "method_params": "Method parameters",
    "scale": "Scale",
    "original_context": "Original context (tokens)",
    "target_length": "Target length (tokens)",
    "pose": "PoSE (positional skip-wise training)",
    "window": "Training window (tokens)",
    "steps": "Optimizer steps",
    "examples_per_step": "Examples per step",
    "per_device_batch_size": "Batch size per device",
    "gradient_accumulation_steps": "Gradient accumulation steps",
    "num_processes": "Processes",
    "learning_rate": "Learning rate",
    "lr_scheduler": "Learning-rate schedule",
    "warmup_steps": "Warm-up steps",
    "weight_decay": "Weight decay",
    "max_grad_norm": "Gradient clipping (max norm)",
    "precision": "Precision",
    "load_in_4bit": "4-bit base weights",
    "gradient_checkpointing": "Gradient checkpointing",
    "tokens_seen": "Tokens seen",
    "tokens_per_second": "Tokens per second",
    "final_loss": "Final training loss",
    "train_time_s": "Training time (s)",
    "wall_time_s": "Wall time (s)",
    "data_files": "Data files",
    "dataset": "Dataset",
    "data_windows": "Training windows available",
    "data_tokens": "Training tokens available",
    "seed": "Seed",
    "device": "Device",
    "versions": "Library versions",
}
_LORA_LABELS = {
    "rank": "LoRA rank",
    "alpha": "LoRA alpha",
    "dropout": "LoRA dropout",
    "target_modules": "LoRA target modules",
    "modules_to_save": "Fully trained modules",
    "trainable_params": "Trainable parameters",
}
# Bookkeeping of the run, not a property of the model: left out of the card.
_TRAINING_SKIPPED = {"base_model_path", "rope_patch", "losses", "adapter_dir", "merged_dir", "resumed_from_step"}
_LONGEST_LIST = 12


def _loss(value: float) -> str:
    """A training loss: four decimals, or four digits where fixed point would print hundreds of them."""
    return f"{value:.4f}" if abs(value) < 1e6 else f"{value:.4g}"


def _training_rows(summary: Mapping[str, Any]) -> list[tuple[str, str]]:
    def shown(value: Any) -> bool:
        if value is None or value == {} or value == []:
            return False
        return not isinstance(value, (list, tuple, Mapping)) or len(value) <= _LONGEST_LIST

    rows = []
    for key, label in _TRAINING_LABELS.items():
        if key in summary and shown(summary[key]):
            value = summary[key]
            rows.append((label, _cell(_loss(value) if key == "final_loss" else _value(value))))
    losses = summary.get("losses")  # checked by _check_training_summary: finite numbers
    if isinstance(losses, list) and len(losses) > 1:
        rows.append(("Loss, first → last step", f"{_loss(losses[0])} → {_loss(losses[-1])}"))
    lora = summary.get("lora")
    if isinstance(lora, Mapping):
        rows += [(label, _cell(_value(lora[key]))) for key, label in _LORA_LABELS.items() if shown(lora.get(key))]
    for key, value in summary.items():  # fields newer runs record
        if key not in _TRAINING_LABELS and key not in _TRAINING_SKIPPED and key != "lora" and shown(value):
            rows.append((_cell(key.replace("_", " ").capitalize()), _cell(_value(value))))
    return rows


# ----------------------------------------------------------------------------------------------
# The card
# ----------------------------------------------------------------------------------------------


def _hub_base_model(candidate: Any) -> str:
    from .arguments import model_label  # the shared alias map: smollm2 -> its Hub id

    if isinstance(candidate, str) and model_label(candidate) != candidate:
        return model_label(candidate)
    if not isinstance(candidate, str) or not _HUB_ID.match(candidate) or Path(candidate).exists():
        raise ValueError(
            f"base_model must be the base model's Hub repo id (like 'HuggingFaceTB/SmolLM2-135M-Instruct'), got "
            f"{candidate!r}; pass base_model= (--base-model on the command line)."
        )
    return candidate


def _patch_label(method: Any, scale: Any) -> str:
    return f"{method} x{scale:g}" if isinstance(scale, (int, float)) and not isinstance(scale, bool) else f"{method}"


def _check_inputs_belong(patch: RecordedPatch, config: Any, summary: Mapping[str, Any] | None,
                         records: list[dict[str, Any]], eval_dir: Any, summary_path: Any) -> None:
    """Refuse a training summary or an evaluation folder of another checkpoint.

    The training run must have made this patch (method, scale, original context and, where the
    summary records it, the method's parameters). The evaluation folder must hold at least one
    result of this checkpoint's patch (method, scale, frequency steps): on this checkpoint
    (``hf-rope-ext eval --model CHECKPOINT --methods METHOD --scales SCALE``, which evaluates a
    save_patched checkpoint from its base RoPE) or on its base model. A ``none`` result of this
    folder is the merged weights at the base RoPE, not the checkpoint as it runs.
    """
    here = _patch_label(patch.label, patch.scale)
    if summary is not None:
        recorded = summary.get("rope_patch") if isinstance(summary.get("rope_patch"), Mapping) else {}
        trained = {
            # the run's method as patch_model took it: "yarn+logn" when log-n attention was on
            "method": method_spec(recorded["method"], recorded.get("logn_attention") is True)
            if isinstance(recorded.get("method"), str) else summary.get("method"),
            "scale": _trained_method_and_scale(summary)[1],
            "original context": recorded.get("original_max_position_embeddings", summary.get("original_context")),
        }
        expected = {"method": patch.label, "scale": patch.scale,
                    "original context": patch.original_max_position_embeddings}  # fmt: skip
        if isinstance(recorded.get("params"), Mapping):
            trained["parameters"] = {key: recorded["params"].get(key) for key in patch.params}
            expected["parameters"] = {key: _as_recorded(value) for key, value in patch.params.items()}
        wrong = [
            f"{key} {trained[key]!r} (checkpoint: {expected[key]!r})"
            for key in expected
            if trained[key] is not None and not _equal(trained[key], expected[key])
        ]
        target = summary.get("target_length")
        if target is not None and (not is_real(target) or target > patch.extended_context):
            wrong.append(f"target_length {target!r} (checkpoint: extended context {patch.extended_context})")
        if wrong:
            raise ValueError(
                f"The training summary {summary_path if isinstance(summary_path, (str, os.PathLike)) else ''} is of "
                f"another run than this {here} checkpoint: {'; '.join(wrong)}. Pass the training_summary.json of the "
                "run that produced it."
            )
    if records:
        folder = getattr(config, "_name_or_path", None)
        unset = _parameters_eval_does_not_set(patch)
        if unset:
            raise ValueError(
                f"This {here} checkpoint's patch has parameters other than its method's defaults "
                f"({', '.join(unset)}), which evaluation results do not record (hf-rope-ext eval applies methods "
                f"with their defaults), so no result in {eval_dir} can be attributed to it; render the card without "
                "--eval-dir."
            )
        if not any(_same_patch(record, patch) for record in records):
            found = sorted({_patch_label(record.get("method"), record.get("scale")) for record in records})
            raise ValueError(
                f"The evaluation folder {eval_dir} holds no result of this {here} checkpoint's patch (its results: "
                f"{', '.join(found)}). Pass the --eval-dir of an evaluation of it (hf-rope-ext eval --model "
                f"{folder or 'CHECKPOINT'} --methods {patch.label} --scales {patch.scale:g}, or the same on the base "
                "model)."
            )


def _check_same_base_model(given: Any, trained: Any, summary_path: Any) -> None:
    """Refuse a --base-model other than the Hub id the training run names (a folder there cannot be compared)."""
    from .arguments import model_label

    if not isinstance(given, str) or not isinstance(trained, str):
        return
    trained = model_label(trained)
    if _HUB_ID.match(trained) and not Path(trained).exists() and model_label(given) != trained:
        where = f"{summary_path} " if isinstance(summary_path, (str, os.PathLike)) else ""
        raise ValueError(
            f"The training summary {where}was trained from {trained!r}, not the base model {given!r} given; pass "
            f"--base-model {trained} (or leave it out to take the summary's), or the summary of this model's run."
        )


def _as_recorded(value: Any) -> Any:
    """A parameter as the patch record writes it (lists for tuples and tensors)."""
    return config_io.json_value(value)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-9)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_equal(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def card_patch_metadata(patch: RecordedPatch) -> dict[str, Any]:
    """The patch a card describes, as its metadata names it: the patch record less the version of
    the package (everything that sets the checkpoint's context, frequencies and attention)."""
    record = json.loads(json.dumps(patch.to_record(), default=config_io.json_value))
    del record["version"]
    return record


def render_model_card(
    config: Any,
    *,
    base_model: str | None = None,
    eval_dir: str | os.PathLike | None = None,
    training_summary: str | os.PathLike | Mapping[str, Any] | None = None,
    repo_id: str | None = None,
    license: str | None = None,
    template_path: str | os.PathLike | None = None,
):
    """``(card, plots)``: a ``huggingface_hub.ModelCard`` for a checkpoint saved from a patched
    model, and the plot files it references.

    Args:
        config: the checkpoint's config (or a patched model): its ``hf_rope_ext`` record
            supplies method, scale, parameters and context lengths. A model's card describes
            the checkpoint :func:`hf_rope_ext.hub.save_patched` writes from it (legacy
            ``attn_factor`` included); a config's, the checkpoint that config was read from.
        base_model: Hub id of the base model; defaults to the training summary's.
        eval_dir: folder with the evaluation tool's ``results.jsonl`` and ``*.png`` plots.
        training_summary: the fine-tuning run's ``training_summary.json`` (path or dict).
        repo_id: where the checkpoint will live, used in the loading instructions.
        license: the license identifier for the metadata (usually the base model's).
        template_path: a Jinja template; default ``hf_rope_ext/templates/model_card.md``.

    The card references the plots by file name; :func:`write_model_card` (or
    :func:`hf_rope_ext.hub.save_patched` with ``card_assets=plots``) puts them next to it.
    """
    import jinja2
    from huggingface_hub import ModelCard, ModelCardData
    from torch import nn

    from . import __version__, get_method, list_methods
    from .hub import runtime_settings

    source = config
    config = getattr(config, "config", config)
    patch = config_io.verify_record(config)
    if patch is None:
        raise ValueError(
            "This config has no hf_rope_ext record, so there is no patch to describe; write the card for a checkpoint "
            "saved from a model patched with hf_rope_ext (hf_rope_ext.hub.save_patched)."
        )
    summary = load_training_summary(training_summary) if isinstance(training_summary, (str, os.PathLike)) else (
        dict(training_summary) if training_summary is not None else None
    )
    if summary is not None:
        _check_training_summary(summary, training_summary)
        _check_same_base_model(base_model, summary.get("base_model"), training_summary)
    base_model = _hub_base_model(base_model or (summary or {}).get("base_model"))
    if repo_id is not None and (not isinstance(repo_id, str) or not _HUB_ID.match(repo_id)):
        # It goes into the card's title and loading instructions.
        raise ValueError(f"repo_id must be a Hub repo id like 'me/SmolLM2-yarn-x4', got {repo_id!r}; pass --repo-id "
                         "OWNER/NAME, or leave it out.")  # fmt: skip
    records, plots = load_eval_results(eval_dir) if eval_dir is not None else ([], [])
    template = Path(template_path) if template_path is not None else DEFAULT_TEMPLATE
    if not template.is_file():
        raise FileNotFoundError(
            f"Model card template {template} not found; it ships inside the hf_rope_ext package. "
            "Pass template_path= (--template)."
        )

    _check_inputs_belong(patch, config, summary, records, eval_dir, training_summary)
    method = patch.rope_method
    logn = patch.logn_attention
    name = repo_id.split("/")[-1] if repo_id else (
        f"{base_model.split('/')[-1]}-{method.name}{'-logn' if logn else ''}-x{patch.scale:g}")
    # What config.json cannot express to transformers: from_pretrained rebuilds the frequencies only.
    attention_changes = ([f"`{method.name}` attention"] if method.attention is not None else []) + (
        ["log-n attention"] if logn else [])
    # A model's card describes the checkpoint save_patched writes from it (with the legacy attn_factor
    # its live config lacks); a config's card, the checkpoint that config was read from.
    settings = runtime_settings(source if isinstance(source, nn.Module) else config)
    eval_results = _eval_results(records, patch)
    card_data = ModelCardData(
        base_model=base_model,
        library_name="transformers",
        pipeline_tag="text-generation",
        license=license,
        tags=["hf-rope-ext", "long-context", "rope-scaling", f"rope-{method.name}"]
        + (["logn-attention"] if logn else []),
        model_name=name if eval_results else None,
        eval_results=eval_results or None,
        # The patch the card describes, for save_patched to check a card against the checkpoint it saves.
        **{CARD_PATCH_KEY: card_patch_metadata(patch)},
    )
    perplexity_rows, bucket_header, bucket_rows = _perplexity_tables(records)
    defaults = get_method(method.name).defaults
    native = method.transformers_rope_type is not None
    plain_note = None
    if method.name == "dynamic" and patch.steps_per_doubling is not None:
        plain_note = (
            f"transformers' `dynamic` follows the input length token by token; this checkpoint was made with "
            f"frequency steps at {patch.steps_per_doubling} per doubling of the length, which plain transformers "
            "reproduces only at those lengths."
        )
    elif method.length_dependent:
        plain_note = (
            "transformers recomputes the frequencies as the input grows but keeps earlier keys in the KV cache "
            "unchanged, so generation beyond the original context can drift from a full forward pass."
        )
    try:
        card = ModelCard.from_template(
            card_data,
            template_path=str(template),
            model_name=name,
            repo_id=repo_id or CARD_PLACEHOLDER_REPO,
            base_model=base_model,
            method=method.name,
            method_summary=_cell(list_methods().get(method.name, "")),
            logn_attention=logn,
            attention_change=" and ".join(attention_changes) or None,
            scale=f"{patch.scale:g}",
            original_context=patch.original_max_position_embeddings,
            extended_context=patch.extended_context,
            rope_theta=f"{patch.original_rope_theta:g}",
            method_params=[(key, _cell(_value(value))) for key, value in patch.params.items() if key in defaults],
            steps_per_doubling=patch.steps_per_doubling if method.length_dependent else None,
            fine_tuned=summary is not None,
            native=native,
            native_rope_type=method.transformers_rope_type,
            custom_rope_type=config_io.custom_rope_type(method),
            plain_transformers_note=plain_note,
            vllm=settings.vllm,
            llama_cpp=settings.llama_cpp,
            llama_cpp_metadata=[(key, _cell(_value(value)))
                                for key, value in settings.llama_cpp.settings.get("gguf_metadata", {}).items()],
            perplexity_rows=perplexity_rows,
            bucket_header=bucket_header,
            bucket_rows=bucket_rows,
            retrieval_rows=_retrieval_table(records),
            plots=[plot.name for plot in plots],
            training_rows=_training_rows({**summary, "base_model": base_model}) if summary else [],
            version=__version__,
        )
    except jinja2.TemplateError as error:
        line = f", line {error.lineno}" if getattr(error, "lineno", None) else ""
        raise ValueError(f"Model card template {template}{line}: {error.message or error}. Fix the template, or leave "
                         "out template_path (--template) for the one shipped with hf_rope_ext.") from None
    return card, plots


def write_model_card(card: Any, output: str | os.PathLike, plots: Iterable[str | os.PathLike] = ()) -> Path:
    """Write ``card`` to ``output`` and copy the plots it references next to it.

    Each file is written to a temporary name and renamed into place, so an interrupted run
    leaves no half-written card or image; if writing fails, the plots copied and the folders
    made by this call are removed again.
    """
    output = Path(output)
    made = [folder for folder in (output.parent, *output.parent.parents) if not folder.exists()]
    copied = []
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        for plot in map(Path, plots):
            destination = output.parent / plot.name
            if destination.resolve() == plot.resolve():
                continue
            new = not destination.exists()
            with atomic_path(destination) as temporary:
                shutil.copyfile(plot, temporary)
            if new:
                copied.append(destination)
        text = str(card) if str(card).endswith("\n") else f"{card}\n"
        atomic_write_text(output, text)
    except BaseException:
        for path in copied:
            path.unlink(missing_ok=True)
        for folder in made:  # deepest first
            try:
                folder.rmdir()
            except OSError:
                pass
        raise
    return output


# ----------------------------------------------------------------------------------------------
# Command line: hf-rope-ext card
# ----------------------------------------------------------------------------------------------


def add_parser(subparsers) -> None:
    from .arguments import HelpFormatter, add_option  # dash spellings; the underscore ones are hidden aliases

    parser = subparsers.add_parser(
        "card",
        formatter_class=HelpFormatter,
        help="render a model card for a patched checkpoint",
        description="Render README.md for a checkpoint saved from a patched model, with loading instructions, the "
        "evaluation tool's results and plots, and the fine-tuning run's summary.",
    )
    add_option(parser, "--model-dir", required=True, help="the saved checkpoint (its config.json is read)")
    add_option(parser, "--eval-dir", help="folder with results.jsonl and *.png from the evaluation tool")
    add_option(parser, "--training-summary", help="training_summary.json of the fine-tuning run")
    add_option(parser, "--base-model", help="Hub id of the base model (default: from the training summary)")
    add_option(parser, "--repo-id", help="Hub repo id the checkpoint is pushed to (used in the instructions)")
    add_option(parser, "--license", help="license identifier for the card metadata")
    add_option(parser, "--template", help="Jinja template (default: the one shipped in hf_rope_ext/templates)")
    add_option(parser, "--output", help="where to write the card (default: MODEL_DIR/README.md)")
    parser.set_defaults(handler=_card_command)


# A checkpoint's own files: a card written over one of them destroys the checkpoint.
_CHECKPOINT_FILES = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                     "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                     "chat_template.jinja", "adapter_config.json"}  # fmt: skip
_WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt"}


def _check_not_a_checkpoint_file(destination: Path, model_dir: Path) -> None:
    """Refuse an ``--output`` that is one of the checkpoint's files (any file there but a markdown one)."""
    target = destination.resolve()
    if target.parent != model_dir.resolve():
        return
    own = target.name in _CHECKPOINT_FILES or target.name.endswith(".index.json")
    if own or target.suffix.lower() in _WEIGHT_SUFFIXES or (target.exists() and target.suffix.lower() != ".md"):
        raise ValueError(
            f"--output {destination} is the checkpoint's own {target.name}; writing the card over it would destroy the "
            f"checkpoint. Leave out --output (the card goes to {model_dir / 'README.md'}) or pass a .md file."
        )


def _card_command(args: argparse.Namespace) -> int:
    from .hub import read_checked_config

    config = read_checked_config(args.model_dir)
    destination = Path(args.output or Path(args.model_dir) / "README.md")
    _check_not_a_checkpoint_file(destination, Path(args.model_dir))
    card, plots = render_model_card(
        config,
        base_model=args.base_model,
        eval_dir=args.eval_dir,
        training_summary=args.training_summary,
        repo_id=args.repo_id,
        license=args.license,
        template_path=args.template,
    )
    try:
        output = write_model_card(card, destination, plots)
    except OSError as error:
        raise OSError(f"Cannot write the model card to {destination}: {error.strerror or error}. Pass a writable "
                      "--output.") from error
    print(f"Wrote {output}" + (f" and {len(plots)} plot(s)" if plots else ""))
    return 0
