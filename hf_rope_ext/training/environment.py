"""What a fine-tuning run needs from the machine: optional packages, CUDA, and the launcher.

Separate from :mod:`hf_rope_ext.training.config` (pure checks of the settings), as these import
optional packages and probe the GPU.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..arguments import check_attention_backend
from .config import FinetuneConfig

__all__ = ["check_4bit_backend", "check_environment", "launched_processes", "make_accelerator"]


def check_4bit_backend() -> None:
    """Refuse ``--load-in-4bit`` without bitsandbytes or without a CUDA GPU."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ValueError(
            "--load-in-4bit (QLoRA) needs the bitsandbytes package, which is not installed: "
            "pip install bitsandbytes (CUDA only)."
        ) from None
    if not torch.cuda.is_available():
        raise ValueError("--load-in-4bit (QLoRA) needs a CUDA GPU; bitsandbytes 4-bit layers do not train on CPU.")


def check_environment(config: FinetuneConfig) -> None:
    """The packages and hardware the settings ask for; raises ``ValueError`` naming the fix."""
    check_attention_backend(config.attn_implementation, half_precision=config.bf16 or config.load_in_4bit,
                            precision_fix="add --bf16")
    if config.load_in_4bit:
        check_4bit_backend()


def launched_processes() -> int:
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


def make_accelerator(config: FinetuneConfig) -> tuple[Any, bool, bool]:
    """``(accelerator, bf16, sharded)``; refuses launches this recipe cannot run correctly."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    launched = launched_processes()
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
            "Under DeepSpeed, set gradient accumulation in the DeepSpeed config and pass --gradient-accumulation-steps 1."
        )
    if sharded and (config.save_steps or config.resume):
        raise ValueError(
            f"Resumable checkpoints (--save-steps, --resume) are implemented for one process and DDP; under "
            f"{accelerator.distributed_type.value} the optimizer state is sharded. Drop --save-steps/--resume or use DDP."
        )
    return accelerator, config.bf16 or accelerator.mixed_precision == "bf16", sharded
