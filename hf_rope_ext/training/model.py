"""The model of a fine-tuning run: the base model patched and wrapped with LoRA, and the way
back from a saved adapter (``adapter/rope_patch.json`` records how to re-patch the base)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from .. import get_patch_info, patch_model
from ..methods import LOGN_SUFFIX, get_method
from ..spec import PatchSpec
from .config import FinetuneConfig, Lengths
from .lora import LoraSettings, apply_lora, check_tied_targets

__all__ = ["ROPE_PATCH_FILE", "build_model", "check_lora_targets", "check_patch", "load_adapter_model", "merge_adapter", "needs_load_patched", "rope_patch_record"]

ROPE_PATCH_FILE = "rope_patch.json"


def load_base(config: FinetuneConfig, path: str, device: torch.device, quantized: bool, bf16: bool):
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


def needs_load_patched(method: str) -> bool:
    """Whether a checkpoint patched with ``method`` needs :func:`hf_rope_ext.hub.load_patched`:
    attention-level methods and log-n attention change attention, which a plain
    ``from_pretrained`` does not rebuild (it restores the frequencies only, and warns)."""
    return method.endswith(LOGN_SUFFIX) or get_method(method).attention is not None


def rope_patch_record(model) -> dict[str, Any]:
    """The patch as the config records it (JSON-ready), written to ``adapter/rope_patch.json``."""
    spec = get_patch_info(model)
    if spec is None:
        raise RuntimeError("The model is not patched.")
    return spec.to_record()


def patch_from_record(model, record: dict[str, Any]) -> None:
    """Patch ``model`` as ``record`` says; the record is verified first (one-line error naming the file)."""
    PatchSpec.from_record(record, source=ROPE_PATCH_FILE).apply(model)


def read_rope_patch_record(adapter_dir: str | os.PathLike) -> dict[str, Any]:
    """``adapter_dir/rope_patch.json``; a missing or unreadable file raises one ``ValueError`` naming it and the fix."""
    adapter_dir = Path(adapter_dir)
    path = adapter_dir / ROPE_PATCH_FILE
    if not path.is_file():
        if (adapter_dir / "adapter" / ROPE_PATCH_FILE).is_file():  # the run's output folder was given
            raise ValueError(f"{adapter_dir} is a fine-tuning run's folder, not its adapter: pass {adapter_dir / 'adapter'}.")
        raise ValueError(
            f"{path} not found: it records how the base model was patched for this adapter. Pass the adapter/ folder "
            "of a fine-tuning run (it holds adapter_config.json and rope_patch.json), or patch the base as the run's "
            "training_summary.json 'rope_patch' says and load the adapter with peft.PeftModel.from_pretrained."
        )
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(
            f"{path} is damaged (not valid JSON: {error}). Restore it from the run's training_summary.json, whose "
            "'rope_patch' entry holds the same record, or rerun the fine-tuning."
        ) from None
    return record


def load_adapter_model(base_model: str, adapter_dir: str | os.PathLike, *, dtype: str = "fp32", attn_implementation: str = "sdpa"):
    """The base model, patched as recorded in ``adapter_dir/rope_patch.json``, with the adapter on top.

    Returns ``(peft_model, tokenizer)`` in eval mode, on CPU.
    """
    from peft import PeftModel

    from ..loading import load_model

    record = read_rope_patch_record(adapter_dir)
    model, tokenizer = load_model(base_model, dtype=dtype, device="cpu", attn_implementation=attn_implementation)
    patch_from_record(model, record)
    return PeftModel.from_pretrained(model, str(adapter_dir)).eval(), tokenizer


def merge_adapter(base_model: str, adapter_dir: str | os.PathLike, *, dtype: str = "fp32"):
    """The LoRA of ``adapter_dir`` merged into the patched base model (unquantized), and its tokenizer.

    Use it to merge an adapter trained on a 4-bit base: merging into 4-bit weights would round
    the update away, so the base is loaded again in ``dtype``.
    """
    peft_model, tokenizer = load_adapter_model(base_model, adapter_dir, dtype=dtype)
    return peft_model.merge_and_unload(), tokenizer


# patch_model arguments the run sets from its own flags.
_SET_BY_FLAGS = {"scale": "--scale", "max_length": "--target-length", "original_max_length": "--original-context",
                 "method": "--method"}


def check_patch(config: FinetuneConfig, lengths: Lengths, model_config) -> None:
    """The patch :func:`build_model` will make, checked from the model's config alone, so that
    bad ``--method-params`` are refused before the weights are loaded (``ValueError``/``TypeError``)."""
    from ..compat import rope_parameters
    from ..config_io import rotary_dim_of
    from ..methods import checked_frequencies

    params = config.parsed_method_params()
    taken = [f"{key!r} (set with {flag})" for key, flag in _SET_BY_FLAGS.items() if key in params]
    if taken:
        raise ValueError(f"--method-params cannot hold {', '.join(taken)}.")
    rope = rope_parameters(model_config)
    rotary_dim = rotary_dim_of(model_config, rope)
    if "partial_rotary_factor" in rope:
        # What build_model's patch_model reads from the module (mixtral, olmo, ... ignore the factor):
        # the model built without weights on the meta device.
        from transformers import AutoModelForCausalLM

        from ..patching import find_rotary_module

        try:
            with torch.device("meta"):
                skeleton = AutoModelForCausalLM.from_config(model_config)
            rotary_dim = 2 * find_rotary_module(skeleton)[1].inv_freq.shape[-1]
        except (ValueError, ImportError, KeyError):  # (remote code, no rotary module): build_model's patch refuses
            pass
    try:
        spec = PatchSpec.create(config.method, lengths.scale, original_max_length=lengths.original,
                                rope_theta=rope["rope_theta"], rotary_dim=rotary_dim, **params)
        # What patch_model adds to the spec's checks: the attention remaps and the frequencies.
        method, resolved = spec.rope_method, spec.resolved_params()
        for remap in (method.attention, method.attention_below_settle):
            if remap is not None:
                remap(resolved)
        checked_frequencies(method, spec.rotary_dim, spec.original_rope_theta, resolved, spec.extended_context)
    except (ValueError, TypeError, ArithmeticError) as error:
        kind = TypeError if isinstance(error, TypeError) else ValueError
        raise kind(f"--method-params {json.dumps(params, default=repr)}: {error}") from None


def check_lora_targets(config: FinetuneConfig, model_config) -> None:
    """LoRA targets on tied embeddings, refused from the model's structure before the weights load
    (the model built without weights on the meta device); :func:`apply_lora` checks again."""
    if not config.lora_target_modules:
        return
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(model_config)
    except (ValueError, ImportError, KeyError, TypeError):  # (remote code): apply_lora refuses after loading
        return
    check_tied_targets(skeleton, config.lora_settings())


def build_model(config: FinetuneConfig, model_path: str, lengths: Lengths, device: torch.device, bf16: bool):
    """The patched base model wrapped with LoRA: ``(peft_model, lora_settings, rope_record)``."""
    from accelerate.utils import set_seed

    set_seed(config.seed)
    model, _ = load_base(config, model_path, device, config.load_in_4bit, bf16)
    model.config.use_cache = False
    patch_model(model, lengths.scale, config.method, original_max_length=lengths.original, **config.parsed_method_params())
    rope_record = rope_patch_record(model)
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
    lora: LoraSettings = config.lora_settings()
    return apply_lora(model, lora), lora, rope_record
