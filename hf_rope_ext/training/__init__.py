"""Fine-tuning that extends the context: PoSE windows, LoRA, resumable checkpoints.

    from hf_rope_ext.training import FinetuneConfig, finetune
    finetune(FinetuneConfig(model="smollm2", output_dir="runs/yarn4", text_files=["book.txt"],
                            method="yarn", scale=4, pose=True, max_steps=100))

See :mod:`hf_rope_ext.training.trainer` for what is written, ``examples/finetune_lora.py`` for
the command line.
"""

from .checkpoint import latest_checkpoint, list_checkpoints
from .lora import LoraSettings, apply_lora, default_lora_targets, norm_module_names
from .trainer import FinetuneConfig, finetune, load_adapter_model, load_documents, merge_adapter
from .windows import PackedWindows, PoseDraw, draw_pose, pose_position_ids

__all__ = [
    "FinetuneConfig",
    "LoraSettings",
    "PackedWindows",
    "PoseDraw",
    "apply_lora",
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
]
