"""Short LoRA fine-tunes that extend a RoPE model's context: the whole recipe in one call.

:func:`finetune` loads a model, patches it with :func:`hf_rope_ext.patch_model` (method and
scale), wraps it with LoRA, trains on long documents cut into windows (full-length or PoSE),
and writes under ``output_dir``::

    checkpoints/step-0000050/   resumable checkpoints (safetensors + JSON), the newest K kept
    adapter/                    the peft adapter + rope_patch.json (how to re-patch the base)
    merged/                     LoRA merged into the patched model: config.json carries the
                                rope scaling, loads with AutoModelForCausalLM.from_pretrained
                                after ``import hf_rope_ext``; for attention-level methods
                                (self-extend, dual-chunk, self-extend-yarn, dynamic-yarn-dca,
                                self-extend-dca, any +logn) that rebuilds only the frequencies
                                (it warns): load it with hf_rope_ext.hub.load_patched
    train_log.jsonl             one line per step: loss, learning rate, tokens/s
    training_summary.json       what was trained, on what, and how it went

It runs in one process (CPU or GPU) or in several under ``accelerate launch`` (DDP: each
process takes its own slice of every step's examples; gradients are averaged). The loss of a
step is the mean over all label tokens of the step, whatever the number of processes, so a
2-process run with batch 1 computes the same update as a 1-process run with batch 2.

Why the references: Position Interpolation (Chen et al. 2023, arXiv 2306.15595) and YaRN
(Peng et al., ICLR 2024) reach their results after a few hundred fine-tuning steps at the
target length; PoSE (Zhu et al., ICLR 2024) makes those steps cost the original context's
memory; LongLoRA (Chen et al., ICLR 2024) shows LoRA then needs trainable embeddings and norms
for large extensions.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..files import atomic_write_json
from ..methods import get_method
from . import checkpoint as ckpt
from .config import SCHEDULERS, FinetuneConfig, Lengths, resolve_lengths
from .environment import check_environment, make_accelerator
from .lora import LoraSettings
from .model import build_model, check_lora_targets, check_patch, load_adapter_model, merge_adapter
from .outputs import (
    LOG_FILE,
    SUMMARY_FILE,
    Progress,
    append_log,
    check_output_dir,
    check_resume_state,
    model_identity,
    read_log,
    remove_stale_staging,
    run_fingerprint,
    save_outputs,
    summary_record,
    truncate_log,
)
from .windows import IGNORE_INDEX, PackedWindows

logger = logging.getLogger(__name__)

# load_adapter_model and merge_adapter live in .model; they stay importable from here.
__all__ = ["FinetuneConfig", "TrainingRun", "finetune", "load_adapter_model", "load_documents", "merge_adapter", "prepare_run"]


def load_documents(config: FinetuneConfig, tokenizer) -> tuple[list[torch.Tensor], list[str]]:
    """Tokenized documents and their names, from ``config.text_files`` or ``config.dataset``."""
    from ..data import iter_dataset_texts, read_text, tokenize

    documents, names = [], []
    if config.text_files:
        for path in config.text_files:
            documents.append(tokenize(tokenizer, read_text(path)))
            names.append(str(path))
    else:
        for index, text in enumerate(
            iter_dataset_texts(config.dataset, config.dataset_split, config.text_field, config.dataset_config, config.dataset_limit)
        ):
            if text and text.strip():
                documents.append(tokenize(tokenizer, text))
                names.append(f"{config.dataset}[{index}]")
        if not documents:
            raise ValueError(f"Dataset {config.dataset} (split {config.dataset_split!r}) has no non-empty {config.text_field!r} text.")
    return documents, names



# -- the run ----------------------------------------------------------------------------------------


def count_label_tokens(windows: PackedWindows, sample_indices: list[int]) -> int:
    """Tokens the loss is taken over (transformers shifts labels left by one)."""
    return sum(int((windows.example(index)["labels"][1:] != IGNORE_INDEX).sum()) for index in sample_indices)


def train_step(accelerator, model, windows: PackedWindows, step_indices: list[int], micro: int, bf16: bool,
               one_window_per_forward: bool = False) -> torch.Tensor:
    """Forward and backward over this process's share of one step; returns its share of the loss.

    The loss is the sum of the cross-entropy over every label token of the step (all processes,
    all micro-batches) divided by their number, so the update does not depend on how the step
    is split. DDP averages gradients over processes, hence the factor ``world``.

    ``one_window_per_forward``: run every example of a micro-batch as its own forward. A
    length-dependent method takes its frequencies (and, for self-extend-yarn and the ``*-dca``
    methods, its attention regime) from the largest position id of a forward; PoSE windows end
    at different positions, so in a shared forward each would get those of the longest one.
    The summed losses keep the weighting above (each divided by the step's label tokens).
    """
    world, rank = accelerator.num_processes, accelerator.process_index
    accumulation = len(step_indices) // (world * micro)
    label_tokens = count_label_tokens(windows, step_indices)
    if label_tokens == 0:  # the loss would be 0 / 0 = nan, and "lower --learning-rate" the wrong advice
        raise ValueError(
            f"A step of {len(step_indices)} example(s) has no label token to train on (PoSE masks the label after "
            "the first chunk): use a longer --window (at least 3 tokens with --pose)."
        )
    label_tokens = torch.tensor(label_tokens, device=accelerator.device)
    forwards = []  # the example indices of each forward of this process
    for micro_step in range(accumulation):
        offset = (micro_step * world + rank) * micro
        micro_batch = step_indices[offset : offset + micro]
        forwards.extend([[index] for index in micro_batch] if one_window_per_forward else [micro_batch])
    loss_share = torch.zeros((), device=accelerator.device)
    for number, indices in enumerate(forwards):
        batch = {key: value.to(accelerator.device) for key, value in windows.batch(indices).items()}
        # DDP averages the gradients once, in the last backward of the step.
        sync = contextlib.nullcontext() if number == len(forwards) - 1 else accelerator.no_sync(model)
        with sync:
            with torch.autocast(accelerator.device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = model(**batch, num_items_in_batch=label_tokens).loss
            accelerator.backward(loss * world)
        loss_share += loss.detach()
    return loss_share


def needs_one_window_per_forward(config: FinetuneConfig) -> bool:
    """PoSE windows of a length-dependent method each need a forward of their own (see :func:`train_step`)."""
    return config.pose and config.per_device_batch_size > 1 and get_method(config.method).length_dependent


@dataclass
class TrainingRun:
    """Everything one run holds between its phases (prepare, resume, train, write)."""

    config: FinetuneConfig
    accelerator: Any
    bf16: bool
    sharded: bool
    model_path: str
    lengths: Lengths
    tokenizer: Any
    windows: PackedWindows
    global_batch: int
    fingerprint: dict[str, Any]
    resume_from: Path | None
    started: float
    model: Any = None
    lora: LoraSettings | None = None
    rope_record: dict[str, Any] | None = None
    trainable: list[tuple[str, torch.nn.Parameter]] = field(default_factory=list)
    optimizer: Any = None
    scheduler: Any = None
    progress: Progress = field(default_factory=Progress)
    resumed_from_step: int | None = None
    log_lines: list[str] | None = None  # the train log to keep (main process), read before the model loads

    @property
    def output_dir(self) -> Path:
        return Path(self.config.output_dir)

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def param_names(self) -> list[str]:
        return [name for name, _ in self.trainable]


def prepare_run(config: FinetuneConfig) -> TrainingRun:
    """Every check, the data and the lengths: bad input is refused here, before the model is loaded."""
    from transformers import AutoTokenizer

    from ..loading import resolve_model_path

    started = time.perf_counter()
    config.validate()
    check_environment(config)
    accelerator, bf16, sharded = make_accelerator(config)
    resume_from = check_output_dir(config)
    model_path = resolve_model_path(config.model)
    model_config = read_base_config(config.model, model_path)
    lengths = resolve_lengths(config, model_config)
    check_patch(config, lengths, model_config)
    check_lora_targets(config, model_config)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    documents, names = load_documents(config, tokenizer)
    windows = PackedWindows(
        documents,
        lengths.window,
        target_length=lengths.target,
        pose=config.pose,
        names=names,
        skip_short_documents=config.skip_short_documents,
        seed=config.seed,
        shuffle=config.shuffle,
    )
    global_batch = config.per_device_batch_size * accelerator.num_processes * config.gradient_accumulation_steps
    if global_batch > len(windows):
        logger.warning("One step uses %d examples but there are only %d windows: examples repeat within a step.", global_batch, len(windows))
    fingerprint = run_fingerprint(config, lengths, global_batch, model_identity(model_path, model_config), bf16=bf16)
    resume_step = 0
    if resume_from is not None:
        state = ckpt.read_trainer_state(resume_from)
        # The default LoRA targets are known once the model is built: compared in restore_checkpoint.
        unknown = ("lora_target_modules",) if fingerprint["lora_target_modules"] is None else ()
        check_resume_state(state, fingerprint, windows.fingerprint(), ignore=unknown)
        resume_step = state["step"]
    log_lines = read_log(Path(config.output_dir) / LOG_FILE, resume_step) if accelerator.is_main_process else None
    return TrainingRun(config, accelerator, bf16, sharded, model_path, lengths, tokenizer, windows, global_batch,
                       fingerprint, resume_from, started, log_lines=log_lines)


def read_base_config(name: str, model_path: str):
    """The model's config; refuses a LoRA adapter folder or an already extended model (a run's
    merged/), whose max_position_embeddings would be taken as the original context."""
    from transformers import AutoConfig

    from ..config_io import read_record

    adapter_config = Path(model_path) / "adapter_config.json"
    if adapter_config.is_file():
        try:
            base = json.loads(adapter_config.read_text(encoding="utf-8")).get("base_model_name_or_path")
        except (ValueError, AttributeError):
            base = None
        raise ValueError(
            f"--model {name} is a LoRA adapter folder, not a model: pass its base model "
            f"({base or 'not named in its adapter_config.json'}) with --model."
        )
    model_config = AutoConfig.from_pretrained(model_path)
    rope = getattr(model_config, "rope_parameters", None)
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if read_record(model_config) is not None or rope_type != "default":
        raise ValueError(
            f"--model {name} is already context-extended (rope_type {rope_type!r}): pass the original base model "
            "with --model (a fine-tuning run's training_summary.json names it as base_model)."
        )
    return model_config


def build_training_state(run: TrainingRun) -> None:
    """The LoRA model, its optimizer and scheduler; restored from the checkpoint when resuming."""
    from transformers import get_scheduler

    config = run.config
    run.model, run.lora, run.rope_record = build_model(config, run.model_path, run.lengths, run.accelerator.device, run.bf16)
    run.fingerprint["lora_target_modules"] = sorted(set(run.lora.resolved_targets))
    run.trainable = [(name, param) for name, param in run.model.named_parameters() if param.requires_grad]
    run.optimizer = torch.optim.AdamW([param for _, param in run.trainable], lr=config.learning_rate, weight_decay=config.weight_decay)
    run.scheduler = get_scheduler(SCHEDULERS[config.lr_scheduler], run.optimizer, num_warmup_steps=config.warmup_steps,
                                  num_training_steps=config.max_steps)
    if run.resume_from is not None:
        restore_checkpoint(run)


def restore_checkpoint(run: TrainingRun) -> None:
    world = run.accelerator.num_processes
    # Again, now that the LoRA targets are resolved, and before any tensor is loaded.
    check_resume_state(ckpt.read_trainer_state(run.resume_from), run.fingerprint, run.windows.fingerprint())
    # Also restores this process's RNG states; nothing below draws from them before training.
    trained, state = ckpt.load_checkpoint(run.resume_from, optimizer=run.optimizer, param_names=run.param_names,
                                          rank=run.accelerator.process_index)
    with torch.no_grad():
        for name, param in run.trainable:
            param.copy_(trained[name].to(param.dtype))
    run.scheduler.load_state_dict(state["scheduler"])
    run.progress = Progress(state["step"], state["tokens_seen"], state["train_time_s"], list(state["losses"]))
    run.resumed_from_step = run.progress.step
    if state.get("world_size") != world:
        logger.warning("Resuming with %d processes; the checkpoint was written with %s.", world, state.get("world_size"))
    logger.info("Resuming from %s at step %d (example %d).", run.resume_from, run.progress.step, run.progress.step * run.global_batch)


def save_run_checkpoint(run: TrainingRun, unwrapped) -> None:
    progress = run.progress
    state = {
        "examples_consumed": progress.step * run.global_batch,  # the data position: examples are numbered
        "tokens_seen": progress.tokens_seen,
        "train_time_s": progress.train_time_s,
        "losses": progress.losses,
        "scheduler": run.scheduler.state_dict(),
        "run": run.fingerprint,
        "data": run.windows.fingerprint(),
    }
    ckpt.save_checkpoint(
        run.output_dir / "checkpoints",
        progress.step,
        trainable={name: param for name, param in unwrapped.named_parameters() if param.requires_grad},
        optimizer=run.optimizer,
        param_names=run.param_names,
        trainer_state=state,
        keep_last=run.config.save_total_limit,
        rank=run.accelerator.process_index,
        world_size=run.accelerator.num_processes,
        barrier=run.accelerator.wait_for_everyone,
    )


def train(run: TrainingRun, model, unwrapped) -> None:
    """The optimizer steps from ``run.progress.step`` to ``max_steps``, with the log and checkpoints."""
    from tqdm.auto import tqdm

    config, accelerator, progress, lengths = run.config, run.accelerator, run.progress, run.lengths
    tokens_per_step = run.global_batch * lengths.window
    logger.info(
        "Training %s (%s, scale %g: %d -> %d tokens) for %d steps of %d x %d tokens%s on %d process(es).",
        config.model, config.method, lengths.scale, lengths.original, lengths.target, config.max_steps,
        run.global_batch, lengths.window, " (PoSE)" if config.pose else "", accelerator.num_processes,
    )
    per_window = needs_one_window_per_forward(config)
    if per_window:
        logger.info("%s is length-dependent: each PoSE window runs as its own forward, with the frequencies of its own "
                    "length.", config.method)
    model.train()
    bar = tqdm(total=config.max_steps, initial=progress.step, desc="fine-tuning", unit="step", disable=not run.main, dynamic_ncols=True)
    run_started, run_start_tokens = time.perf_counter(), progress.tokens_seen
    while progress.step < config.max_steps:
        step_started = time.perf_counter()
        first = progress.step * run.global_batch
        step_indices = list(range(first, first + run.global_batch))
        loss_share = train_step(accelerator, model, run.windows, step_indices, config.per_device_batch_size, run.bf16,
                                one_window_per_forward=per_window)
        if config.max_grad_norm > 0:
            accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        run.optimizer.step()
        run.scheduler.step()
        run.optimizer.zero_grad(set_to_none=True)
        loss = float(accelerator.reduce(loss_share, reduction="sum"))
        if not math.isfinite(loss):
            raise FloatingPointError(f"The loss became {loss} at step {progress.step + 1}; lower --learning-rate or check the data.")
        step_time = time.perf_counter() - step_started
        progress.step += 1
        progress.tokens_seen += tokens_per_step
        progress.train_time_s += step_time
        progress.losses.append(loss)
        learning_rate = run.scheduler.get_last_lr()[0]
        speed = (progress.tokens_seen - run_start_tokens) / max(time.perf_counter() - run_started, 1e-9)
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{speed:.0f}", lr=f"{learning_rate:.2e}")
        bar.update(1)
        if run.main:
            append_log(run.output_dir / LOG_FILE, {
                "step": progress.step, "loss": loss, "learning_rate": learning_rate, "tokens_seen": progress.tokens_seen,
                "step_time_s": round(step_time, 4), "tokens_per_second": round(tokens_per_step / step_time, 2),
            })
        if config.save_steps and (progress.step % config.save_steps == 0 or progress.step == config.max_steps):
            save_run_checkpoint(run, unwrapped)
    bar.close()
    model.eval()


def write_outputs(run: TrainingRun, model, unwrapped) -> dict[str, Any]:
    """``adapter/``, ``merged/`` and the summary (main process); returns the summary ({} elsewhere)."""
    config = run.config
    state_dict = run.accelerator.get_state_dict(model)  # every process takes part (gathers shards under FSDP)
    summary: dict[str, Any] = {}
    if run.main:
        merge_dtype = "bf16" if run.bf16 or config.load_in_4bit else "fp32"
        save_outputs(config, run.output_dir, unwrapped, state_dict, run.tokenizer, run.rope_record, run.model_path,
                     reload_to_merge=config.load_in_4bit or run.sharded, merge_dtype=merge_dtype)
        summary = summary_record(config, run.lengths, run.lora, run.progress, run.rope_record,
                                 model_path=run.model_path, windows=run.windows, global_batch=run.global_batch,
                                 world=run.accelerator.num_processes,
                                 trainable_params=sum(param.numel() for _, param in run.trainable), bf16=run.bf16,
                                 resumed_from_step=run.resumed_from_step, device=run.accelerator.device,
                                 wall_time_s=time.perf_counter() - run.started)
        atomic_write_json(run.output_dir / SUMMARY_FILE, summary)
        logger.info("Wrote %s (final loss %.4f, %.0f tokens/s).", run.output_dir, summary["final_loss"], summary["tokens_per_second"] or 0)
    run.accelerator.wait_for_everyone()
    return summary


def finetune(config: FinetuneConfig) -> dict[str, Any]:
    """Run the whole recipe (see the module docstring); returns the training summary
    (an empty dict on processes other than the main one).

    Bad input (settings, lengths, text, the output folder) is refused before the model is
    loaded; a resumed run that differs from its checkpoint, before the first step.
    """
    run = prepare_run(config)
    build_training_state(run)
    model, run.optimizer = run.accelerator.prepare(run.model, run.optimizer)
    unwrapped = run.accelerator.unwrap_model(model)
    if run.main:
        run.output_dir.mkdir(parents=True, exist_ok=True)
        truncate_log(run.output_dir / LOG_FILE, run.progress.step, run.log_lines)
        for folder in (run.output_dir, run.output_dir / "checkpoints"):  # left by a run killed while saving
            remove_stale_staging(folder)
    train(run, model, unwrapped)
    return write_outputs(run, model, unwrapped)
