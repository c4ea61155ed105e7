"""What a fine-tuning run writes under ``output_dir``, and the checks that protect it.

Every output folder (``adapter/``, ``merged/``, ``checkpoints/step-N/``) is written through
:func:`hf_rope_ext.files.atomic_directory`: a run killed half way leaves the previous folder
or none, never a partial one.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..files import atomic_directory, atomic_write_json, atomic_write_text, file_in_the_way
from ..hub import save_patched
from . import checkpoint as ckpt
from .config import FinetuneConfig, Lengths
from .lora import LoraSettings
from .model import ROPE_PATCH_FILE, merge_adapter
from .windows import PackedWindows

__all__ = [
    "LOG_FILE",
    "SUMMARY_FILE",
    "Progress",
    "append_log",
    "check_output_dir",
    "check_resume_state",
    "model_identity",
    "read_log",
    "remove_stale_staging",
    "run_fingerprint",
    "save_outputs",
    "summary_record",
    "truncate_log",
]

SUMMARY_FILE = "training_summary.json"
LOG_FILE = "train_log.jsonl"
# Parts of the names atomic_directory, save_patched and save_checkpoint give their temporary
# folders (".<name>.staging-XXXX" beside a new folder, ".hf_rope_ext.staging-XXXX" inside an existing
# one), and checkpoint.remove_checkpoint's ".removing-" (an old checkpoint being deleted).
# Not ".old-": a run killed mid-swap may have only that copy.
STAGING_MARKERS = (".staging-", ".saving-", ckpt.REMOVING_MARKER)

logger = logging.getLogger(__name__)


@dataclass
class Progress:
    """What a run has done so far; carried over by a resume."""

    step: int = 0
    tokens_seen: int = 0
    train_time_s: float = 0.0
    losses: list[float] = field(default_factory=list)


def check_output_dir(config: FinetuneConfig) -> Path | None:
    """The checkpoint to resume from, if any; refuses to overwrite an earlier run's outputs."""
    output_dir = Path(config.output_dir)
    blocking = file_in_the_way(output_dir)
    if blocking is not None:  # found here, not by mkdir once the model has loaded
        where = "is a file" if blocking == output_dir else f"is inside {blocking}, a file"
        raise ValueError(f"--output-dir {output_dir} {where}, not a folder. Choose a folder for the run's outputs.")
    checkpoints = output_dir / "checkpoints"
    latest = ckpt.latest_checkpoint(checkpoints)
    finished = [name for name in ("adapter", "merged", SUMMARY_FILE) if (output_dir / name).exists()]
    if config.resume:
        if latest is None and finished:  # a run made without --save-steps: nothing to continue from
            raise ValueError(
                f"--resume: {output_dir} holds a run ({', '.join(finished)}) but no checkpoint in {checkpoints} (run "
                "without --save-steps, or its checkpoints were deleted), so it cannot be continued. Choose a new "
                "--output-dir; nothing is overwritten."
            )
        if latest is None:
            raise ValueError(f"--resume: no checkpoint in {checkpoints}. Run without --resume to start afresh.")
        return latest
    if latest is not None:
        raise ValueError(
            f"{output_dir} already holds a run ({latest.name}). Pass --resume to continue it from its newest "
            "checkpoint, or choose a new --output-dir; nothing is overwritten."
        )
    if finished:
        raise ValueError(
            f"{output_dir} already holds a run ({', '.join(finished)}) without a checkpoint to continue from. Choose a "
            "new --output-dir; nothing is overwritten."
        )
    return None


def remove_stale_staging(folder: Path) -> None:
    """Remove the temporary folders a run killed while saving left in ``folder``."""
    if not folder.is_dir():
        return
    for entry in folder.iterdir():
        if entry.name.startswith(".") and any(marker in entry.name for marker in STAGING_MARKERS):
            shutil.rmtree(entry, ignore_errors=True)


# How much of each end of a weight file model_identity reads: enough to tell models apart
# (the header names the tensors, the data differs), cheap for multi-GB files.
SAMPLE_BYTES = 1 << 20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def model_identity(model_path: str, model_config: Any) -> str:
    """A short fingerprint of the base model, so a resume on another model is refused.

    A local folder: a hash of config.json and of the weight files' names, sizes and first and
    last MiB (not the whole multi-GB weights). A Hub id: the id at its resolved commit.
    """
    folder = Path(model_path)
    if not folder.is_dir():
        return f"{model_path}@{getattr(model_config, '_commit_hash', None) or 'unknown revision'}"
    weights = hashlib.sha256()
    for path in sorted(path for path in folder.iterdir() if path.suffix in WEIGHT_SUFFIXES and path.is_file()):
        size = path.stat().st_size
        weights.update(f"{path.name}:{size}:".encode())
        with open(path, "rb") as handle:
            weights.update(handle.read(SAMPLE_BYTES))
            handle.seek(max(size - SAMPLE_BYTES, handle.tell()))
            weights.update(handle.read(SAMPLE_BYTES))
    config_hash = hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()
    return f"config {config_hash[:16]}, weights {weights.hexdigest()[:16]}"


def run_fingerprint(config: FinetuneConfig, lengths: Lengths, global_batch: int, base_model: str, *,
                    bf16: bool | None = None) -> dict[str, Any]:
    """Settings a resumed run must share with the run that wrote the checkpoint.

    Values are compared as meant, not as typed: the parsed method parameters, and the LoRA
    targets as a sorted list (None until the model resolves the default; see the trainer).
    ``bf16``: whether the run trains in bf16 (``--bf16`` or the launcher's ``--mixed_precision bf16``),
    recorded as ``precision``; default: the ``--bf16`` flag.
    """
    keys = ("method", "pose", "lora_rank", "lora_alpha", "lora_dropout", "train_embeddings", "train_norms",
            "max_steps", "learning_rate", "weight_decay", "warmup_steps", "lr_scheduler", "max_grad_norm", "seed",
            "shuffle", "load_in_4bit")
    fingerprint = {key: getattr(config, key) for key in keys}
    # The precision the run trains in, not the flag: a launcher's --mixed_precision bf16 counts too.
    fingerprint["precision"] = "bf16" if (config.bf16 if bf16 is None else bf16) else "fp32"
    fingerprint["method_params"] = config.parsed_method_params()
    fingerprint["lora_target_modules"] = sorted(set(config.lora_target_modules)) if config.lora_target_modules else None
    fingerprint["base_model"] = base_model
    fingerprint.update(asdict(lengths))
    fingerprint["global_batch"] = global_batch
    return fingerprint


# What a resume refusal adds after a setting that no single flag sets.
RESUME_HINTS = {
    "global_batch": " (examples per step = processes x --per-device-batch-size x --gradient-accumulation-steps: keep "
                    "the product, e.g. double --gradient-accumulation-steps when halving the processes)",
    "precision": " (bf16 comes from --bf16 or from `accelerate launch --mixed_precision bf16`: resume with the one the "
                 "run used)",
}


def _precision_of_older_record(saved: dict[str, Any], now: str) -> dict[str, Any]:
    """A fingerprint written before the precision was recorded holds the ``--bf16`` flag only:
    ``True`` means bf16; ``False`` may have been a launcher's bf16 as well, which cannot be told,
    so the precision of this run is taken (with a warning when that is bf16)."""
    flag_on = saved["bf16"]
    saved = {key: value for key, value in saved.items() if key != "bf16"}
    if flag_on is True:
        saved["precision"] = "bf16"
    elif flag_on is False:
        saved["precision"] = now
        if now == "bf16":
            logger.warning("The checkpoint was written by an earlier version, which did not record whether the launcher "
                           "trained in bf16: resuming in bf16; if that run trained in fp32, start afresh instead.")
    return saved


def check_resume_state(state: dict[str, Any], run: dict[str, Any], data: dict[str, Any], *, ignore: tuple[str, ...] = ()) -> None:
    """Refuse a checkpoint written with other settings, data or base model (``ignore``: settings not known yet)."""
    if isinstance(state.get("run"), dict) and "base_model" not in state["run"]:
        raise ValueError(
            "Cannot resume: the checkpoint was written by an earlier version of hf_rope_ext, which did not record the "
            "base model, so a resume could not be checked. Start afresh in a new --output-dir (the checkpoint is left "
            "as it is)."
        )
    saved_run = state.get("run")
    if isinstance(saved_run, dict) and "precision" not in saved_run and "bf16" in saved_run and "precision" in run:
        saved_run = _precision_of_older_record(saved_run, run["precision"])
    for label, saved, now in (("settings", saved_run, run), ("training data", state.get("data"), data)):
        saved = {key: value for key, value in (saved or {}).items() if key not in ignore}
        now = {key: value for key, value in now.items() if key not in ignore}
        if saved != now:
            differing = sorted(key for key in set(saved) | set(now) if saved.get(key) != now.get(key))
            details = ", ".join(f"{key}: {saved.get(key)!r} -> {now.get(key)!r}{RESUME_HINTS.get(key, '')}"
                                for key in differing[:6])
            raise ValueError(
                f"Cannot resume: the checkpoint was written with different {label} ({details}). "
                "Resume with the same --model, arguments and data, or start a new --output-dir."
            )


def save_outputs(config: FinetuneConfig, output_dir: Path, peft_model, state_dict, tokenizer, rope_record, model_path: str, *,
                 reload_to_merge: bool, merge_dtype: str) -> None:
    """Write ``adapter/`` and ``merged/``, each replacing an older folder of the same name whole."""
    adapter_dir = output_dir / "adapter"
    with atomic_directory(adapter_dir) as staging:
        peft_model.save_pretrained(str(staging), state_dict=state_dict)
        (staging / "README.md").unlink(missing_ok=True)  # peft's empty card template; the summary describes the run
        atomic_write_json(staging / ROPE_PATCH_FILE, rope_record)
        tokenizer.save_pretrained(str(staging))
    if not config.save_merged:
        return
    if reload_to_merge:
        # 4-bit weights would round the LoRA update away, and sharded weights are not local:
        # merge into a fresh unquantized copy of the base model instead.
        gc.collect()
        merged, _ = merge_adapter(model_path, adapter_dir, dtype=merge_dtype)
    else:
        merged = peft_model.merge_and_unload()
    merged.config.use_cache = True
    # save_patched: the 4.x `rope_scaling` keys, the tokenizer's model_max_length raised to the
    # extended context, and the saved config read back and checked, as for any patched checkpoint.
    with atomic_directory(output_dir / "merged") as staging:
        save_patched(merged, staging, tokenizer=tokenizer)


def summary_record(config: FinetuneConfig, lengths: Lengths, lora: LoraSettings, progress: Progress, rope_record, *,
                   model_path: str, windows: PackedWindows, global_batch: int, world: int, trainable_params: int,
                   bf16: bool, resumed_from_step: int | None, device: torch.device, wall_time_s: float) -> dict[str, Any]:
    """``training_summary.json``: what was trained, on what, and how it went."""
    return {
        "base_model": config.model,
        "base_model_path": str(model_path),
        "method": config.method,
        "method_params": config.parsed_method_params(),
        "rope_patch": rope_record,
        "scale": lengths.scale,
        "original_context": lengths.original,
        "target_length": lengths.target,
        "pose": config.pose,
        "window": lengths.window,
        "steps": progress.step,
        "examples_per_step": global_batch,
        "per_device_batch_size": config.per_device_batch_size,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "num_processes": world,
        "lora": {
            "rank": lora.rank,
            "alpha": lora.alpha,
            "dropout": lora.dropout,
            "target_modules": lora.resolved_targets,
            "modules_to_save": lora.modules_to_save,
            "trainable_params": trainable_params,
        },
        "learning_rate": config.learning_rate,
        "lr_scheduler": config.lr_scheduler,
        "warmup_steps": config.warmup_steps,
        "weight_decay": config.weight_decay,
        "max_grad_norm": config.max_grad_norm,
        "seed": config.seed,
        "precision": "bf16" if bf16 else "fp32",
        "load_in_4bit": config.load_in_4bit,
        "gradient_checkpointing": config.gradient_checkpointing,
        "attn_implementation": config.attn_implementation,
        "tokens_seen": progress.tokens_seen,
        "train_time_s": round(progress.train_time_s, 3),
        "tokens_per_second": round(progress.tokens_seen / progress.train_time_s, 2) if progress.train_time_s else None,
        "final_loss": progress.losses[-1],
        "losses": progress.losses,
        "wall_time_s": round(wall_time_s, 3),
        "resumed_from_step": resumed_from_step,
        "data_files": list(config.text_files or []),
        "dataset": config.dataset,
        "data_windows": len(windows),
        "data_tokens": windows.num_tokens,
        "adapter_dir": "adapter",
        "merged_dir": "merged" if config.save_merged else None,
        "device": str(device),
        "versions": versions(),
    }


def versions() -> dict[str, str]:
    import accelerate
    import peft
    import transformers

    from .. import __version__

    return {"hf_rope_ext": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "peft": peft.__version__, "accelerate": accelerate.__version__}


def append_log(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")


def read_log(path: Path, step: int) -> list[str] | None:
    """The lines of the log up to ``step`` (None: no log).

    A cut-off last line is what a run killed while writing leaves: it is dropped with a warning.
    A bad line elsewhere means the log was damaged otherwise, and raises ``ValueError``.
    """
    if not path.is_file():
        return None
    if step == 0:  # a fresh start keeps nothing of a run killed before its first checkpoint
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    kept = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry_step = json.loads(line)["step"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            if number == len(lines):
                logger.warning("%s: dropping its cut-off last line %d (%s).", path, number, error)
                continue
            raise ValueError(
                f"{path} line {number} is not a log record ({error}). Delete or fix that line, or start afresh in a "
                "new --output-dir."
            ) from None
        if entry_step <= step:
            kept.append(line)
    return kept


def truncate_log(path: Path, step: int, kept: list[str] | None = None) -> None:
    """Keep the log lines up to ``step`` (a resumed run rewrites what came after its checkpoint);
    ``kept``: those lines, as :func:`read_log` returned them already."""
    kept = read_log(path, step) if kept is None else kept
    if kept is not None:
        atomic_write_text(path, "".join(line + "\n" for line in kept))
