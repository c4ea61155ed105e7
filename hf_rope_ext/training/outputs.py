"""What a fine-tuning run writes under ``output_dir``, and the checks that protect it.

Every output folder (``adapter/``, ``merged/``, ``checkpoints/step-N/``) is written through
:func:`hf_rope_ext.files.atomic_directory`: a run killed half way leaves the previous folder
or none, never a partial one.
"""

from __future__ import annotations

import gc
import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..files import atomic_directory, atomic_write_json, atomic_write_text
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
    "remove_stale_staging",
    "run_fingerprint",
    "save_outputs",
    "summary_record",
    "truncate_log",
]

SUMMARY_FILE = "training_summary.json"
LOG_FILE = "train_log.jsonl"
# Parts of the names atomic_directory, save_patched and save_checkpoint give their temporary
# folders (".<name>.staging-XXXX"). Not ".old-": a run killed mid-swap may have only that copy.
STAGING_MARKERS = (".staging-", ".saving-")


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
    checkpoints = output_dir / "checkpoints"
    latest = ckpt.latest_checkpoint(checkpoints)
    finished = [name for name in ("adapter", "merged", SUMMARY_FILE) if (output_dir / name).exists()]
    if config.resume:
        if latest is None:
            raise ValueError(f"--resume: no checkpoint in {checkpoints}. Run without --resume to start afresh.")
        return latest
    if latest is not None or finished:
        found = [latest.name] if latest is not None else finished
        raise ValueError(
            f"{output_dir} already holds a run ({', '.join(found)}). Pass --resume to continue it from its newest "
            "checkpoint, or choose a new --output-dir; nothing is overwritten."
        )
    return None


def remove_stale_staging(folder: Path) -> None:
    """Remove the temporary folders a run killed while saving left in ``folder``."""
    if not folder.is_dir():
        return
    for entry in folder.iterdir():
        if entry.name.startswith(".") and any(marker in entry.name for marker in STAGING_MARKERS):
            shutil.rmtree(entry, ignore_errors=True)


def run_fingerprint(config: FinetuneConfig, lengths: Lengths, global_batch: int) -> dict[str, Any]:
    """Settings a resumed run must share with the run that wrote the checkpoint."""
    keys = ("method", "method_params", "pose", "lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules",
            "train_embeddings", "train_norms", "max_steps", "learning_rate", "weight_decay", "warmup_steps",
            "lr_scheduler", "max_grad_norm", "seed", "shuffle", "load_in_4bit", "bf16")
    fingerprint = {key: getattr(config, key) for key in keys}
    fingerprint.update(asdict(lengths))
    fingerprint["global_batch"] = global_batch
    return fingerprint


def check_resume_state(state: dict[str, Any], run: dict[str, Any], data: dict[str, Any]) -> None:
    for label, saved, now in (("settings", state.get("run"), run), ("training data", state.get("data"), data)):
        if saved != now:
            differing = sorted(key for key in set(saved or {}) | set(now) if (saved or {}).get(key) != now.get(key))
            details = ", ".join(f"{key}: {(saved or {}).get(key)!r} -> {now.get(key)!r}" for key in differing[:6])
            raise ValueError(
                f"Cannot resume: the checkpoint was written with different {label} ({details}). "
                "Resume with the same arguments and data, or start a new --output-dir."
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


def truncate_log(path: Path, step: int) -> None:
    """Keep the log lines up to ``step`` (a resumed run rewrites what came after its checkpoint)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip() and json.loads(line)["step"] <= step]
    atomic_write_text(path, "".join(line + "\n" for line in kept))
