"""Short LoRA fine-tunes that extend a RoPE model's context: the whole recipe in one call.

:func:`finetune` loads a model, patches it with :func:`hf_rope_ext.patch_model` (method and
scale), wraps it with LoRA, trains on long documents cut into windows (full-length or PoSE),
and writes under ``output_dir``::

    checkpoints/step-0000050/   resumable checkpoints (safetensors + JSON), the newest K kept
    adapter/                    the peft adapter + rope_patch.json (how to re-patch the base)
    merged/                     LoRA merged into the patched model: config.json carries the
                                rope scaling, loads with AutoModelForCausalLM.from_pretrained
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
import gc
import json
import logging
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import get_method, get_patch_info, patch_model
from ..patching import whole_token_scale
from ..spec import PatchSpec
from ..files import give_umask_permissions, staging_dir
from . import checkpoint as ckpt
from .lora import LoraSettings, apply_lora
from .windows import IGNORE_INDEX, PackedWindows

logger = logging.getLogger(__name__)

__all__ = ["FinetuneConfig", "finetune", "load_documents", "merge_adapter", "load_adapter_model"]

SCHEDULERS = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
ROPE_PATCH_FILE = "rope_patch.json"
SUMMARY_FILE = "training_summary.json"
LOG_FILE = "train_log.jsonl"


@dataclass
class FinetuneConfig:
    """Every setting of a fine-tuning run (the example script's command-line arguments)."""

    model: str = field(metadata={"help": "base model: a folder, a Hub id, or 'smollm2' (the offline SmolLM2-135M-Instruct)"})
    output_dir: str = field(metadata={"help": "every output goes here (checkpoints, adapter, merged model, summary)"})
    # data
    text_files: list[str] | None = field(default=None, metadata={"help": "UTF-8 text files, one document each"})
    dataset: str | None = field(default=None, metadata={"help": "a datasets dataset (Hub id or local folder) instead of text files"})
    dataset_config: str | None = field(default=None, metadata={"help": "dataset configuration name"})
    dataset_split: str = field(default="train", metadata={"help": "dataset split"})
    text_field: str = field(default="text", metadata={"help": "dataset column holding the text"})
    dataset_limit: int | None = field(default=None, metadata={"help": "use at most this many dataset rows"})
    skip_short_documents: bool = field(default=False, metadata={"help": "drop documents shorter than a window instead of failing"})
    shuffle: bool = field(default=True, metadata={"help": "visit windows in a seeded random order each epoch"})
    # context extension
    method: str = field(default="yarn", metadata={"help": "RoPE scaling method (hf-rope-ext methods lists them)"})
    scale: float | None = field(default=None, metadata={"help": "extension factor s: target length = s x original context"})
    target_length: int | None = field(default=None, metadata={"help": "target context in tokens (instead of --scale)"})
    original_context: int | None = field(default=None, metadata={"help": "context the model was trained on (default: config.max_position_embeddings)"})
    method_params: str | None = field(default=None, metadata={"help": 'the method\'s own parameters as JSON, e.g. \'{"beta_fast": 32}\''})
    pose: bool = field(default=False, metadata={"help": "PoSE: short windows whose position ids are spread over the target length"})
    window: int | None = field(default=None, metadata={"help": "tokens per example (default: original context with --pose, else the target length)"})
    # LoRA
    lora_rank: int = field(default=16, metadata={"help": "LoRA rank r"})
    lora_alpha: float = field(default=32.0, metadata={"help": "LoRA alpha (update scaled by alpha / r)"})
    lora_dropout: float = field(default=0.0, metadata={"help": "dropout on the LoRA input"})
    lora_target_modules: list[str] | None = field(default=None, metadata={"help": "linear layer names to adapt (default: all but the output head)"})
    train_embeddings: bool = field(default=False, metadata={"help": "also train the input embeddings (LongLoRA)"})
    train_norms: bool = field(default=False, metadata={"help": "also train the normalization layers (LongLoRA)"})
    # optimisation
    max_steps: int = field(default=200, metadata={"help": "optimizer steps"})
    learning_rate: float = field(default=2e-4, metadata={"help": "peak learning rate (AdamW)"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    warmup_steps: int = field(default=0, metadata={"help": "linear warmup steps"})
    lr_scheduler: str = field(default="constant", metadata={"help": "after warmup: constant, linear or cosine decay"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "clip the gradient norm (0: no clipping)"})
    per_device_batch_size: int = field(default=1, metadata={"help": "examples per process per micro-batch"})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    seed: int = field(default=0, metadata={"help": "seed for LoRA initialisation, data order, PoSE draws and dropout"})
    # memory savers
    bf16: bool = field(default=False, metadata={"help": "bfloat16 base weights and autocast (LoRA weights stay float32)"})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "recompute activations in the backward pass"})
    attn_implementation: str = field(default="sdpa", metadata={"help": "sdpa, eager, flash_attention_2 or flash_attention_3"})
    load_in_4bit: bool = field(default=False, metadata={"help": "QLoRA: 4-bit NF4 base model (needs bitsandbytes and CUDA)"})
    # checkpoints and outputs
    save_steps: int = field(default=0, metadata={"help": "write a resumable checkpoint every N steps (0: never)"})
    save_total_limit: int = field(default=2, metadata={"help": "keep the newest N checkpoints"})
    resume: bool = field(default=False, metadata={"help": "continue from the newest checkpoint in output_dir/checkpoints"})
    save_merged: bool = field(default=True, metadata={"help": "also write the merged model (LoRA folded into the weights)"})

    def validate(self) -> None:
        """Checks that need neither the model nor the data; raises ``ValueError`` naming the fix."""
        if not self.output_dir:
            raise ValueError("output_dir is required: every output of the run is written under it.")
        if not self.text_files and not self.dataset:
            raise ValueError("No training text: give --text_files FILE [FILE ...] or --dataset NAME.")
        if self.text_files and self.dataset:
            raise ValueError("Give either --text_files or --dataset, not both.")
        missing = [str(path) for path in self.text_files or [] if not Path(path).is_file()]
        if missing:
            raise FileNotFoundError(f"Text file not found: {', '.join(missing)} (given with --text_files).")
        if self.scale is None and self.target_length is None:
            raise ValueError("Give --scale (e.g. 4) or --target_length (tokens) for the context to reach.")
        for name in ("max_steps", "per_device_batch_size", "gradient_accumulation_steps", "save_total_limit", "lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name} must be a positive integer, got {value!r}.")
        for name in ("save_steps", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name} must be >= 0, got {getattr(self, name)}.")
        if self.warmup_steps >= self.max_steps:
            raise ValueError(f"--warmup_steps ({self.warmup_steps}) must be smaller than --max_steps ({self.max_steps}).")
        if not self.learning_rate > 0:
            raise ValueError(f"--learning_rate must be > 0, got {self.learning_rate}.")
        if self.lr_scheduler not in SCHEDULERS:
            raise ValueError(f"--lr_scheduler must be one of {sorted(SCHEDULERS)}, got {self.lr_scheduler!r}.")
        if self.max_grad_norm < 0:
            raise ValueError(f"--max_grad_norm must be >= 0 (0 turns clipping off), got {self.max_grad_norm}.")
        if self.dataset_limit is not None and self.dataset_limit < 1:
            raise ValueError(f"--dataset_limit must be a positive number of rows, got {self.dataset_limit}.")
        self.lora_settings().validate()
        if self.window is not None and self.window < 2:
            raise ValueError(f"--window must be at least 2 tokens, got {self.window}.")
        get_method(self.method)  # raises with the list of methods
        self.parsed_method_params()
        if self.attn_implementation not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"--attn_implementation must be one of {ATTENTION_IMPLEMENTATIONS}, got {self.attn_implementation!r}.")
        if self.attn_implementation.startswith("flash_attention"):
            module = "flash_attn" if self.attn_implementation == "flash_attention_2" else "flash_attn_interface"
            try:
                __import__(module)
            except ImportError:
                raise ValueError(
                    f"--attn_implementation {self.attn_implementation} needs the {module} package, which is not "
                    "installed (pip install flash-attn --no-build-isolation; CUDA only). Use --attn_implementation sdpa."
                ) from None
            if not torch.cuda.is_available():
                raise ValueError(f"--attn_implementation {self.attn_implementation} runs on CUDA only; use sdpa on CPU.")
            if not (self.bf16 or self.load_in_4bit):
                raise ValueError(f"--attn_implementation {self.attn_implementation} needs half precision: add --bf16.")
        if self.load_in_4bit:
            try:
                import bitsandbytes  # noqa: F401
            except ImportError:
                raise ValueError(
                    "--load_in_4bit (QLoRA) needs the bitsandbytes package, which is not installed: "
                    "pip install bitsandbytes (CUDA only)."
                ) from None
            if not torch.cuda.is_available():
                raise ValueError("--load_in_4bit (QLoRA) needs a CUDA GPU; bitsandbytes 4-bit layers do not train on CPU.")
        if self.save_steps > self.max_steps:
            logger.warning("--save_steps %d is beyond --max_steps %d: no intermediate checkpoint will be written.", self.save_steps, self.max_steps)

    def parsed_method_params(self) -> dict[str, Any]:
        if not self.method_params:
            return {}
        try:
            params = json.loads(self.method_params)
        except json.JSONDecodeError as error:
            raise ValueError(f"--method_params must be a JSON object, e.g. '{{\"beta_fast\": 32}}': {error}") from None
        if not isinstance(params, dict):
            raise ValueError(f"--method_params must be a JSON object, got {self.method_params!r}.")
        return params

    def lora_settings(self) -> LoraSettings:
        return LoraSettings(
            rank=self.lora_rank,
            alpha=self.lora_alpha,
            dropout=self.lora_dropout,
            target_modules=self.lora_target_modules,
            train_embeddings=self.train_embeddings,
            train_norms=self.train_norms,
        )


@dataclass(frozen=True)
class _Lengths:
    original: int
    target: int
    scale: float
    window: int


def _resolve_lengths(config: FinetuneConfig, model_config: Any) -> _Lengths:
    original = config.original_context or getattr(model_config, "max_position_embeddings", None)
    if not original:
        raise ValueError("The model config has no max_position_embeddings; pass --original_context.")
    if config.scale is not None and config.target_length is not None:
        tokens = math.floor(original * config.scale + 0.5)  # patch_model's rule: the nearest whole token
        if config.target_length != tokens:
            raise ValueError(
                f"--scale {config.scale} and --target_length {config.target_length} disagree: with an original "
                f"context of {original}, scale {config.scale} means {tokens} tokens. Give one."
            )
    if config.target_length is not None:
        target, scale = int(config.target_length), config.target_length / original
    else:  # the rule of patch_model: a whole number of tokens
        scale = whole_token_scale(float(config.scale), original) if config.scale > 1 else float(config.scale)
        target = math.floor(original * scale + 0.5)
    if target <= original:
        raise ValueError(
            f"The target length ({target} tokens) must be beyond the original context of {original} tokens "
            "(scale > 1); there is nothing to extend."
        )
    if config.pose:
        window = config.window or original
        if window > original:
            raise ValueError(
                f"PoSE windows must fit the original context: --window {window} > {original}. "
                "Use a smaller --window, or drop --pose to train on full-length windows."
            )
    else:
        window = config.window or target
        if window > target:
            raise ValueError(f"--window {window} is longer than the target length {target}.")
        if window < target:
            logger.warning(
                "Training on %d-token windows without PoSE: positions %d..%d are never trained. Add --pose to "
                "spread the positions over the target length.", window, window, target - 1,
            )
    return _Lengths(original, target, scale, window)


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


# -- model ---------------------------------------------------------------------------------------


def _load_base(config: FinetuneConfig, path: str, device: torch.device, quantized: bool, bf16: bool):
    from ..loading import load_model

    kwargs: dict[str, Any] = {}
    if quantized:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
        kwargs["device_map"] = {"": device}
    model, tokenizer = load_model(
        path,
        dtype="bf16" if (bf16 or quantized) else "fp32",
        device=str(device),
        attn_implementation=config.attn_implementation,
        **kwargs,
    )
    return model, tokenizer


def _rope_patch_record(model) -> dict[str, Any]:
    """The patch as :mod:`hf_rope_ext.config_io` records it in the config (JSON-ready)."""
    spec = get_patch_info(model)
    if spec is None:
        raise RuntimeError("The model is not patched.")
    return spec.to_record()


def _patch_from_record(model, record: dict[str, Any]) -> None:
    PatchSpec.from_record(record, source=ROPE_PATCH_FILE).apply(model)


def load_adapter_model(base_model: str, adapter_dir: str | os.PathLike, *, dtype: str = "fp32", attn_implementation: str = "sdpa"):
    """The base model, patched as recorded in ``adapter_dir/rope_patch.json``, with the adapter on top.

    Returns ``(peft_model, tokenizer)`` in eval mode, on CPU.
    """
    from peft import PeftModel

    from ..loading import load_model

    record = json.loads((Path(adapter_dir) / ROPE_PATCH_FILE).read_text(encoding="utf-8"))
    model, tokenizer = load_model(base_model, dtype=dtype, device="cpu", attn_implementation=attn_implementation)
    _patch_from_record(model, record)
    return PeftModel.from_pretrained(model, str(adapter_dir)).eval(), tokenizer


def merge_adapter(base_model: str, adapter_dir: str | os.PathLike, *, dtype: str = "fp32"):
    """The LoRA of ``adapter_dir`` merged into the patched base model (unquantized), and its tokenizer.

    Use it to merge an adapter trained on a 4-bit base: merging into 4-bit weights would round
    the update away, so the base is loaded again in ``dtype``.
    """
    peft_model, tokenizer = load_adapter_model(base_model, adapter_dir, dtype=dtype)
    return peft_model.merge_and_unload(), tokenizer


# -- output folders --------------------------------------------------------------------------------


def _publish(staging: Path, final: Path) -> None:
    """Move a finished folder into place; an older one of the same name is removed only afterwards."""
    old = None
    if final.exists():
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        os.replace(final, old)
    os.replace(staging, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _staging_dir(output_dir: Path, name: str) -> Path:
    return staging_dir(output_dir, f".tmp-{name}-")


def _check_output_dir(config: FinetuneConfig, output_dir: Path) -> Path | None:
    """The checkpoint to resume from, if any; refuses to overwrite an earlier run's outputs."""
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
            "checkpoint, or choose a new --output_dir; nothing is overwritten."
        )
    return None


def _run_fingerprint(config: FinetuneConfig, lengths: _Lengths, global_batch: int) -> dict[str, Any]:
    """Settings a resumed run must share with the run that wrote the checkpoint."""
    keys = ("method", "method_params", "pose", "lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules",
            "train_embeddings", "train_norms", "max_steps", "learning_rate", "weight_decay", "warmup_steps",
            "lr_scheduler", "max_grad_norm", "seed", "shuffle", "load_in_4bit", "bf16")
    fingerprint = {key: getattr(config, key) for key in keys}
    fingerprint.update(asdict(lengths))
    fingerprint["global_batch"] = global_batch
    return fingerprint


def _check_resume_state(state: dict[str, Any], run: dict[str, Any], data: dict[str, Any]) -> None:
    for label, saved, now in (("settings", state.get("run"), run), ("training data", state.get("data"), data)):
        if saved != now:
            differing = sorted(key for key in set(saved or {}) | set(now) if (saved or {}).get(key) != now.get(key))
            details = ", ".join(f"{key}: {(saved or {}).get(key)!r} -> {now.get(key)!r}" for key in differing[:6])
            raise ValueError(
                f"Cannot resume: the checkpoint was written with different {label} ({details}). "
                "Resume with the same arguments and data, or start a new --output_dir."
            )


# -- the run ----------------------------------------------------------------------------------------


@dataclass
class _Progress:
    """What a run has done so far; carried over by a resume."""

    step: int = 0
    tokens_seen: int = 0
    train_time_s: float = 0.0
    losses: list[float] = field(default_factory=list)


def _launched_processes() -> int:
    """How many processes the launcher started (torchrun or MPI), as accelerate counts them."""
    for name in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"):
        if os.environ.get(name):
            return int(os.environ[name])
    # `accelerate launch --cpu --num_processes N` (N > 1) without MPI starts ONE plain process;
    # its only trace is the rendezvous address it sets. Refuse rather than train alone.
    cpu_launch = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    if cpu_launch and os.environ.get("MASTER_ADDR"):
        raise ValueError(
            "`accelerate launch --cpu --num_processes N` started a single process (accelerate needs MPI for that). "
            "For several CPU processes use `accelerate launch --multi_gpu --num_processes N ...` or "
            "`--config_file examples/accelerate_configs/ddp.yaml`: without CUDA they train over gloo."
        )
    return 1


def _make_accelerator(config: FinetuneConfig):
    """``(accelerator, bf16, sharded)``; refuses launches this recipe cannot run correctly."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    launched = _launched_processes()
    # Several processes on a machine without CUDA (torchrun, `accelerate launch --multi_gpu`):
    # accelerate forms a gloo process group only when told to use the CPU. Mixed precision is
    # this run's own autocast rather than accelerate's process-wide setting, so runs in one
    # process may differ; a launcher's `--mixed_precision bf16` is honoured as well.
    accelerator = Accelerator(cpu=launched > 1 and not torch.cuda.is_available())
    if accelerator.num_processes != launched:
        raise RuntimeError(
            f"{launched} processes were launched but accelerate sees {accelerator.num_processes}; they would each "
            "train alone and overwrite each other's outputs. Check the accelerate configuration."
        )
    if accelerator.mixed_precision == "fp16":
        raise ValueError("fp16 mixed precision is not supported (it needs loss scaling); launch with bf16 or use --bf16.")
    sharded = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
    if accelerator.distributed_type == DistributedType.DEEPSPEED and config.gradient_accumulation_steps > 1:
        raise ValueError(
            "Under DeepSpeed, set gradient accumulation in the DeepSpeed config and pass --gradient_accumulation_steps 1."
        )
    if sharded and (config.save_steps or config.resume):
        raise ValueError(
            f"Resumable checkpoints (--save_steps, --resume) are implemented for one process and DDP; under "
            f"{accelerator.distributed_type.value} the optimizer state is sharded. Drop --save_steps/--resume or use DDP."
        )
    return accelerator, config.bf16 or accelerator.mixed_precision == "bf16", sharded


def _build_model(config: FinetuneConfig, model_path: str, lengths: _Lengths, device: torch.device, bf16: bool):
    """The patched base model wrapped with LoRA: ``(peft_model, lora_settings, rope_record)``."""
    from accelerate.utils import set_seed

    set_seed(config.seed)
    model, _ = _load_base(config, model_path, device, config.load_in_4bit, bf16)
    model.config.use_cache = False
    patch_model(model, lengths.scale, config.method, original_max_length=lengths.original, **config.parsed_method_params())
    rope_record = _rope_patch_record(model)
    if config.load_in_4bit:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=config.gradient_checkpointing)
    if config.gradient_checkpointing:
        # Non-reentrant checkpointing works with DDP and needs no input gradients for LoRA.
        if hasattr(model, "activation_checkpointing_enable"):  # the name in recent transformers 5.x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    set_seed(config.seed)  # the LoRA initialisation must not depend on what loading drew
    lora = config.lora_settings()
    return apply_lora(model, lora), lora, rope_record


def _label_tokens(windows: PackedWindows, sample_indices: list[int]) -> int:
    """Tokens the loss is taken over (transformers shifts labels left by one)."""
    return sum(int((windows.example(index)["labels"][1:] != IGNORE_INDEX).sum()) for index in sample_indices)


def _train_step(accelerator, model, windows: PackedWindows, step_indices: list[int], micro: int, bf16: bool) -> torch.Tensor:
    """Forward and backward over this process's share of one step; returns its share of the loss.

    The loss is the sum of the cross-entropy over every label token of the step (all processes,
    all micro-batches) divided by their number, so the update does not depend on how the step
    is split. DDP averages gradients over processes, hence the factor ``world``.
    """
    world, rank = accelerator.num_processes, accelerator.process_index
    accumulation = len(step_indices) // (world * micro)
    label_tokens = torch.tensor(_label_tokens(windows, step_indices), device=accelerator.device)
    loss_share = torch.zeros((), device=accelerator.device)
    for micro_step in range(accumulation):
        offset = (micro_step * world + rank) * micro
        batch = {key: value.to(accelerator.device) for key, value in windows.batch(step_indices[offset : offset + micro]).items()}
        sync = contextlib.nullcontext() if micro_step == accumulation - 1 else accelerator.no_sync(model)
        with sync:
            with torch.autocast(accelerator.device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = model(**batch, num_items_in_batch=label_tokens).loss
            accelerator.backward(loss * world)
        loss_share += loss.detach()
    return loss_share


def finetune(config: FinetuneConfig) -> dict[str, Any]:
    """Run the whole recipe (see the module docstring); returns the training summary
    (an empty dict on processes other than the main one).

    Bad input (settings, lengths, text, the output folder) is refused before the model is
    loaded; a resumed run that differs from its checkpoint, before the first step.
    """
    from tqdm.auto import tqdm
    from transformers import AutoConfig, AutoTokenizer, get_scheduler

    from ..loading import resolve_model_path

    started = time.perf_counter()
    config.validate()
    accelerator, bf16, sharded = _make_accelerator(config)
    main, world, rank = accelerator.is_main_process, accelerator.num_processes, accelerator.process_index
    output_dir = Path(config.output_dir)
    resume_from = _check_output_dir(config, output_dir)

    model_path = resolve_model_path(config.model)
    lengths = _resolve_lengths(config, AutoConfig.from_pretrained(model_path))
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
    micro = config.per_device_batch_size
    global_batch = micro * world * config.gradient_accumulation_steps
    if global_batch > len(windows):
        logger.warning("One step uses %d examples but there are only %d windows: examples repeat within a step.", global_batch, len(windows))
    run_fingerprint = _run_fingerprint(config, lengths, global_batch)

    model, lora, rope_record = _build_model(config, model_path, lengths, accelerator.device, bf16)
    trainable = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    param_names = [name for name, _ in trainable]
    optimizer = torch.optim.AdamW([param for _, param in trainable], lr=config.learning_rate, weight_decay=config.weight_decay)
    scheduler = get_scheduler(SCHEDULERS[config.lr_scheduler], optimizer, num_warmup_steps=config.warmup_steps, num_training_steps=config.max_steps)

    progress = _Progress()
    if resume_from is not None:
        # Also restores this process's RNG states; nothing below draws from them before training.
        trained, state = ckpt.load_checkpoint(resume_from, optimizer=optimizer, param_names=param_names, rank=rank)
        _check_resume_state(state, run_fingerprint, windows.fingerprint())
        with torch.no_grad():
            for name, param in trainable:
                param.copy_(trained[name].to(param.dtype))
        scheduler.load_state_dict(state["scheduler"])
        progress = _Progress(state["step"], state["tokens_seen"], state["train_time_s"], list(state["losses"]))
        if state.get("world_size") != world:
            logger.warning("Resuming with %d processes; the checkpoint was written with %s.", world, state.get("world_size"))
        logger.info("Resuming from %s at step %d (example %d).", resume_from, progress.step, progress.step * global_batch)
    resumed_from_step = progress.step if resume_from is not None else None

    model, optimizer = accelerator.prepare(model, optimizer)
    unwrapped = accelerator.unwrap_model(model)
    if main:
        output_dir.mkdir(parents=True, exist_ok=True)
        _truncate_log(output_dir / LOG_FILE, progress.step)
        for stale in output_dir.glob(".tmp-*"):  # staging folders of a run killed while saving
            shutil.rmtree(stale, ignore_errors=True)

    def save_checkpoint() -> None:
        state = {
            "examples_consumed": progress.step * global_batch,  # the data position: examples are numbered
            "tokens_seen": progress.tokens_seen,
            "train_time_s": progress.train_time_s,
            "losses": progress.losses,
            "scheduler": scheduler.state_dict(),
            "run": run_fingerprint,
            "data": windows.fingerprint(),
        }
        ckpt.save_checkpoint(
            output_dir / "checkpoints",
            progress.step,
            trainable={name: param for name, param in unwrapped.named_parameters() if param.requires_grad},
            optimizer=optimizer,
            param_names=param_names,
            trainer_state=state,
            keep_last=config.save_total_limit,
            rank=rank,
            world_size=world,
            barrier=accelerator.wait_for_everyone,
        )

    tokens_per_step = global_batch * lengths.window
    logger.info(
        "Training %s (%s, scale %g: %d -> %d tokens) for %d steps of %d x %d tokens%s on %d process(es).",
        config.model, config.method, lengths.scale, lengths.original, lengths.target, config.max_steps,
        global_batch, lengths.window, " (PoSE)" if config.pose else "", world,
    )
    model.train()
    bar = tqdm(total=config.max_steps, initial=progress.step, desc="fine-tuning", unit="step", disable=not main, dynamic_ncols=True)
    run_started, run_start_tokens = time.perf_counter(), progress.tokens_seen
    while progress.step < config.max_steps:
        step_started = time.perf_counter()
        first = progress.step * global_batch
        loss_share = _train_step(accelerator, model, windows, list(range(first, first + global_batch)), micro, bf16)
        if config.max_grad_norm > 0:
            accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss = float(accelerator.reduce(loss_share, reduction="sum"))
        if not math.isfinite(loss):
            raise FloatingPointError(f"The loss became {loss} at step {progress.step + 1}; lower --learning_rate or check the data.")
        step_time = time.perf_counter() - step_started
        progress.step += 1
        progress.tokens_seen += tokens_per_step
        progress.train_time_s += step_time
        progress.losses.append(loss)
        learning_rate = scheduler.get_last_lr()[0]
        speed = (progress.tokens_seen - run_start_tokens) / max(time.perf_counter() - run_started, 1e-9)
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{speed:.0f}", lr=f"{learning_rate:.2e}")
        bar.update(1)
        if main:
            _append_log(output_dir / LOG_FILE, {
                "step": progress.step, "loss": loss, "learning_rate": learning_rate, "tokens_seen": progress.tokens_seen,
                "step_time_s": round(step_time, 4), "tokens_per_second": round(tokens_per_step / step_time, 2),
            })
        if config.save_steps and (progress.step % config.save_steps == 0 or progress.step == config.max_steps):
            save_checkpoint()
    bar.close()
    model.eval()

    state_dict = accelerator.get_state_dict(model)  # every process takes part (gathers shards under FSDP)
    summary: dict[str, Any] = {}
    if main:
        merge_dtype = "bf16" if bf16 or config.load_in_4bit else "fp32"
        _save_outputs(config, output_dir, unwrapped, state_dict, tokenizer, rope_record, model_path,
                      reload_to_merge=config.load_in_4bit or sharded, merge_dtype=merge_dtype)
        summary = _summary(config, lengths, lora, progress, rope_record,
                           model_path=model_path, windows=windows, global_batch=global_batch, world=world,
                           trainable_params=sum(param.numel() for _, param in trainable), bf16=bf16,
                           resumed_from_step=resumed_from_step, device=accelerator.device,
                           wall_time_s=time.perf_counter() - started)
        ckpt.atomic_write_json(output_dir / SUMMARY_FILE, summary)
        logger.info("Wrote %s (final loss %.4f, %.0f tokens/s).", output_dir, summary["final_loss"], summary["tokens_per_second"] or 0)
    accelerator.wait_for_everyone()
    return summary


def _save_outputs(config, output_dir: Path, peft_model, state_dict, tokenizer, rope_record, model_path: str, *,
                  reload_to_merge: bool, merge_dtype: str) -> None:
    """Write ``adapter/`` and ``merged/``, each to a temporary folder renamed into place."""
    adapter_dir = output_dir / "adapter"
    staging = _staging_dir(output_dir, "adapter")
    try:
        peft_model.save_pretrained(str(staging), state_dict=state_dict)
        (staging / "README.md").unlink(missing_ok=True)  # peft's empty card template; the summary describes the run
        ckpt.atomic_write_json(staging / ROPE_PATCH_FILE, rope_record)
        tokenizer.save_pretrained(str(staging))
        give_umask_permissions(staging)
        _publish(staging, adapter_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if not config.save_merged:
        return
    staging = _staging_dir(output_dir, "merged")
    try:
        if reload_to_merge:
            # 4-bit weights would round the LoRA update away, and sharded weights are not local:
            # merge into a fresh unquantized copy of the base model instead.
            gc.collect()
            merged, _ = merge_adapter(model_path, adapter_dir, dtype=merge_dtype)
        else:
            merged = peft_model.merge_and_unload()
        merged.config.use_cache = True
        merged.save_pretrained(str(staging))
        tokenizer.save_pretrained(str(staging))
        give_umask_permissions(staging)
        _publish(staging, output_dir / "merged")
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _summary(config: FinetuneConfig, lengths: _Lengths, lora: LoraSettings, progress: _Progress, rope_record, *,
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
        "versions": _versions(),
    }


def _versions() -> dict[str, str]:
    import accelerate
    import peft
    import transformers

    from .. import __version__

    return {"hf_rope_ext": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "peft": peft.__version__, "accelerate": accelerate.__version__}


def _append_log(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")


def _truncate_log(path: Path, step: int) -> None:
    """Keep the log lines up to ``step`` (a resumed run rewrites what came after its checkpoint)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip() and json.loads(line)["step"] <= step]
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(staging, path)
