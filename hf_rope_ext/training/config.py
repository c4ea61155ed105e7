"""The settings of a fine-tuning run, their checks, and the lengths they resolve to.

Everything here is pure: no optional package is imported and no GPU is probed (that is
:mod:`hf_rope_ext.training.environment`), so bad settings are refused in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import numbers
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..arguments import (
    ATTENTION_IMPLEMENTATIONS,
    add_attn_implementation_argument,
    add_data_arguments,
    add_dataclass_arguments,
    add_model_argument,
    add_output_dir_argument,
    given_options,
)
from ..methods import get_method, plain_value
from ..patching import original_context_length, resolve_scale
from ..validation import is_finite
from .lora import LoraSettings

logger = logging.getLogger(__name__)

__all__ = ["FinetuneConfig", "Lengths", "SCHEDULERS", "add_finetune_arguments", "config_from_args", "resolve_lengths"]

SCHEDULERS = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}

# On/off settings: a string such as "no" would be truthy.
SWITCHES = ("skip_short_documents", "shuffle", "pose", "train_embeddings", "train_norms", "bf16", "gradient_checkpointing",
            "load_in_4bit", "resume", "save_merged")
# The dataset settings and their defaults: with --text-files they would do nothing.
DATASET_SETTINGS = {"dataset_config": None, "dataset_split": "train", "text_field": "text", "dataset_limit": None}


def dataset_flags_refusal(given: list[str]) -> str:
    """The refusal of dataset-only flags (``given``, their spellings) in a run on ``--text-files``."""
    verb, pronoun = ("applies", "it") if len(given) == 1 else ("apply", "them")
    return f"{', '.join(given)} only {verb} to --dataset; drop {pronoun} when training on --text-files."


def is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def flag(name: str) -> str:
    """The command-line spelling of a setting: ``warmup_steps`` -> ``--warmup-steps``."""
    return "--" + name.replace("_", "-")


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
        """Checks that need neither the model, the data nor the machine; raises ``ValueError``
        (``TypeError`` for a wrong type, ``FileNotFoundError`` for a missing text file) naming the fix.

        The optional packages and the GPU are checked by
        :func:`hf_rope_ext.training.environment.check_environment`.
        """
        # A sweep script's numpy numbers (np.int64(2), np.float32(1e-4)) as the plain Python ones
        # they stand for: checked as such below, and written to JSON (summary, fingerprint) as such.
        for name in (setting.name for setting in fields(self)):
            value = getattr(self, name)
            if isinstance(value, numbers.Number) and type(value) not in (bool, int, float):
                setattr(self, name, plain_value(value))
        if not self.output_dir:
            raise ValueError("output_dir is required: every output of the run is written under it.")
        for name in ("text_files", "lora_target_modules"):
            value = getattr(self, name)
            # A lone string would be read as a list of its characters.
            if isinstance(value, (str, bytes, os.PathLike)):
                raise TypeError(f"{name} must be a list, e.g. {name}=[{str(value)!r}], got the single value {value!r}.")
        if not self.text_files and not self.dataset:
            raise ValueError("No training text: give --text-files FILE [FILE ...] or --dataset NAME.")
        if self.text_files and self.dataset:
            raise ValueError("Give either --text-files or --dataset, not both.")
        if self.text_files:
            given = [flag(name) for name, default in DATASET_SETTINGS.items() if getattr(self, name) != default]
            if given:
                raise ValueError(dataset_flags_refusal(given))
        for name in SWITCHES:
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{flag(name)} must be True or False, got {getattr(self, name)!r}.")
        missing = [str(path) for path in self.text_files or [] if not Path(path).is_file()]
        if missing:
            raise FileNotFoundError(f"Text file not found: {', '.join(missing)} (given with --text-files).")
        if self.scale is None and self.target_length is None:
            raise ValueError("Give --scale (e.g. 4) or --target-length (tokens) for the context to reach.")
        for name in ("max_steps", "per_device_batch_size", "gradient_accumulation_steps", "save_total_limit", "lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag(name)} must be a positive integer, got {value!r}.")
        for name in ("save_steps", "warmup_steps"):
            value = getattr(self, name)
            if not is_integer(value) or value < 0:
                raise ValueError(f"{flag(name)} must be an integer >= 0, got {value!r}.")
        if self.warmup_steps >= self.max_steps:
            raise ValueError(f"--warmup-steps ({self.warmup_steps}) must be smaller than --max-steps ({self.max_steps}).")
        # NaN passes every comparison's negation and inf only fails later, inside the optimizer.
        if not is_finite(self.learning_rate) or self.learning_rate <= 0:
            raise ValueError(f"--learning-rate must be a finite number > 0, got {self.learning_rate!r}.")
        if self.lr_scheduler not in SCHEDULERS:
            raise ValueError(f"--lr-scheduler must be one of {sorted(SCHEDULERS)}, got {self.lr_scheduler!r}.")
        if not is_finite(self.max_grad_norm) or self.max_grad_norm < 0:
            raise ValueError(
                f"--max-grad-norm must be a finite number >= 0 (0 turns clipping off), got {self.max_grad_norm!r}."
            )
        if not is_finite(self.weight_decay) or self.weight_decay < 0:
            raise ValueError(f"--weight-decay must be a finite number >= 0, got {self.weight_decay!r}.")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:
            raise ValueError(f"--seed must be an integer in [0, 2**32), got {self.seed!r}.")
        if self.dataset_limit is not None and (not is_integer(self.dataset_limit) or self.dataset_limit < 1):
            raise ValueError(f"--dataset-limit must be a positive number of rows, got {self.dataset_limit!r}.")
        self.lora_settings().validate()
        if self.window is not None and (not is_integer(self.window) or self.window < 2):
            raise ValueError(f"--window must be an integer of at least 2 tokens, got {self.window!r}.")
        get_method(self.method)  # raises with the list of methods
        self.parsed_method_params()
        if self.attn_implementation not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"--attn-implementation must be one of {ATTENTION_IMPLEMENTATIONS}, got {self.attn_implementation!r}.")
        if self.save_steps > self.max_steps:
            logger.warning("--save-steps %d is beyond --max-steps %d: no intermediate checkpoint will be written.", self.save_steps, self.max_steps)

    def parsed_method_params(self) -> dict[str, Any]:
        """The method's own parameters: ``method_params`` is a JSON object or, from Python, a dict."""
        if not self.method_params:
            return {}
        if isinstance(self.method_params, dict):
            # numpy numbers as plain ones: the parameters are written to JSON (checkpoints, summary)
            return {key: plain_value(value) for key, value in self.method_params.items()}
        if not isinstance(self.method_params, str):
            raise TypeError(
                f"method_params must be a JSON object as a string or a dict, got {type(self.method_params).__name__}."
            )
        try:
            params = json.loads(self.method_params)
        except json.JSONDecodeError as error:
            raise ValueError(f"--method-params must be a JSON object, e.g. '{{\"beta_fast\": 32}}': {error}") from None
        if not isinstance(params, dict):
            raise ValueError(f"--method-params must be a JSON object, got {self.method_params!r}.")
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


# -- lengths -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Lengths:
    """The lengths of a run, in tokens, and the scale patch_model is called with."""

    original: int
    target: int
    scale: float
    window: int


def requested_tokens(value: Any, original: int, *, is_scale: bool) -> int | None:
    """``value`` (a scale or a length) as a number of tokens, rounded to the nearest token as
    patch_model rounds; None when it is not a finite number (the shared resolver then says why)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        return None
    return math.floor(original * value + 0.5) if is_scale else int(value)


def resolve_lengths(config: FinetuneConfig, model_config: Any) -> Lengths:
    """The original and target context, the scale and the window of a run.

    The target is resolved by :func:`hf_rope_ext.patching.resolve_scale`, the rule patch_model
    applies, so the model is trained for exactly the context patch_model gives it. Before that,
    the errors a fine-tuning user meets most are given in terms of the script's flags.
    """
    if config.original_context is None and getattr(model_config, "max_position_embeddings", None) is None:
        raise ValueError("The model config has no max_position_embeddings; pass --original-context.")
    original = original_context_length(model_config, config.original_context)
    from_scale = None if config.scale is None else requested_tokens(config.scale, original, is_scale=True)
    if config.target_length is not None and from_scale is not None and config.target_length != from_scale:
        raise ValueError(
            f"--scale {config.scale} and --target-length {config.target_length} disagree: with an original "
            f"context of {original}, scale {config.scale} means {from_scale} tokens. Give one."
        )
    requested = from_scale if config.target_length is None else requested_tokens(config.target_length, original, is_scale=False)
    if requested is not None and requested <= original:
        raise ValueError(
            f"The target length ({requested} tokens) must be beyond the original context of {original} tokens "
            "(scale > 1); there is nothing to extend."
        )
    # Both given and equal: the length is the exact request.
    if config.target_length is not None:
        scale = resolve_scale(None, config.target_length, original)
    else:
        scale = resolve_scale(config.scale, None, original)
    target = math.floor(original * scale + 0.5)
    if config.pose:
        window = config.window or original
        # l1 >= 1 and, after a content skip, the label after the first chunk is masked: a window
        # of W tokens has W - 2 labels, so W = 2 can leave a step with nothing to learn from.
        if window < 3:
            raise ValueError(
                f"PoSE needs --window of at least 3 tokens (a 2-token window can have no label), got {window}."
            )
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
    return Lengths(original, target, scale, window)


# -- the command line --------------------------------------------------------------------------------

# Arguments added by the shared helpers of hf_rope_ext.arguments rather than from the dataclass.
SHARED_FIELDS = ("model", "output_dir", "text_files", "dataset", "dataset_config", "dataset_split", "text_field",
                 "attn_implementation")


def add_finetune_arguments(parser: argparse.ArgumentParser) -> None:
    """Every :class:`FinetuneConfig` setting as a dash-spelled option (underscore spellings are
    hidden aliases); the model, data and attention options are the shared ones."""
    group = parser.add_argument_group("model and data")
    add_model_argument(group, default=None, help=FinetuneConfig.__dataclass_fields__["model"].metadata["help"])
    add_output_dir_argument(group, help=FinetuneConfig.__dataclass_fields__["output_dir"].metadata["help"])
    add_data_arguments(group, dataset_split="train")
    add_attn_implementation_argument(group)
    add_dataclass_arguments(parser.add_argument_group("training"), FinetuneConfig, exclude=SHARED_FIELDS)


def config_from_args(args: argparse.Namespace) -> FinetuneConfig:
    """The :class:`FinetuneConfig` of arguments parsed with :func:`add_finetune_arguments`.

    Raises ``ValueError`` for a dataset-only flag given with ``--text-files``: here, where it is
    known whether the flag was given, not only whether its value differs from the default."""
    values = {name: getattr(args, name) for name in FinetuneConfig.__dataclass_fields__}
    values["output_dir"] = str(values["output_dir"])
    values["text_files"] = [str(path) for path in values["text_files"]] or None
    given = [flag(name) for name in DATASET_SETTINGS if name in given_options(args)]
    if values["text_files"] and not values["dataset"] and given:  # both: validate() says to give one
        raise ValueError(dataset_flags_refusal(given))
    return FinetuneConfig(**values)
