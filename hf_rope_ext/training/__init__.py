"""Fine-tuning that extends the context: PoSE windows, LoRA, resumable checkpoints.

    from hf_rope_ext.training import FinetuneConfig, finetune
    finetune(FinetuneConfig(model="smollm2", output_dir="runs/yarn4", text_files=["book.txt"],
                            method="yarn", scale=4, pose=True, max_steps=100))

The modules: ``config`` (the settings, their pure checks, the lengths they resolve to, the
command-line options), ``environment`` (optional packages, CUDA, the launcher), ``model`` (the
patched LoRA model and the way back from an adapter), ``outputs`` (what is written under
``output_dir``), ``checkpoint`` (resumable checkpoints), ``windows`` (PoSE and full-length
examples) and ``trainer`` (the loop). See :mod:`hf_rope_ext.training.trainer` for what is
written, ``examples/finetune_lora.py`` for the command line.
"""

from .checkpoint import latest_checkpoint, list_checkpoints
from .config import FinetuneConfig, Lengths, add_finetune_arguments, config_from_args, resolve_lengths
from .environment import check_environment
from .lora import LoraSettings, apply_lora, default_lora_targets, norm_module_names
from .model import load_adapter_model, merge_adapter
from .trainer import finetune, load_documents
from .windows import PackedWindows, PoseDraw, draw_pose, pose_position_ids

__all__ = [
    "FinetuneConfig",
    "Lengths",
    "LoraSettings",
    "PackedWindows",
    "PoseDraw",
    "add_finetune_arguments",
    "apply_lora",
    "check_environment",
    "config_from_args",
    "default_lora_targets",
    "draw_pose",
    "finetune",
    "latest_checkpoint",
    "list_checkpoints",
    "load_adapter_model",
    "load_documents",
    "merge_adapter",
    "norm_module_names",
    "pose_position_ids",
    "resolve_lengths",
]
