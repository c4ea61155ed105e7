r"""Fine-tune a RoPE model with LoRA to extend its context (PoSE windows optional).

One process (CPU or GPU); SmolLM2-135M-Instruct from 8k to 32k tokens with PoSE windows of
2048 tokens (60 steps took 787 s with yarn on 2 CPU cores, 1332 s with linear on a shared CPU):

    python examples/finetune_lora.py --model smollm2 --output-dir outputs/ft-yarn-x4 \
        --text-files ../shared/data/books/pg1342.txt ../shared/data/books/pg2701.txt \
        --method yarn --scale 4 --pose --window 2048 --lora-rank 16 --lora-alpha 32 --train-norms \
        --max-steps 60 --learning-rate 3e-4 --warmup-steps 5 --save-steps 20 --seed 0

Several processes (DDP; FSDP and DeepSpeed configs are in examples/accelerate_configs/). On a
machine without CUDA this starts CPU processes joined over gloo (`accelerate launch --cpu
--num_processes 2` would start only one, and is refused):

    accelerate launch --config_file examples/accelerate_configs/ddp.yaml examples/finetune_lora.py <same arguments>

Interrupted? Run the same command with --resume: it continues from the newest checkpoint in
<output-dir>/checkpoints at the same step and data position. Everything is written under
--output-dir: checkpoints/, adapter/, merged/, train_log.jsonl and training_summary.json.
merged/ loads with AutoModelForCausalLM.from_pretrained after `import hf_rope_ext`, except for
attention-level methods (self-extend, dual-chunk, self-extend-yarn, dynamic-yarn-dca,
self-extend-dca, any +logn): from_pretrained rebuilds only their frequencies (it warns), so
load those with hf_rope_ext.hub.load_patched. All arguments:
`python examples/finetune_lora.py --help` (the underscore spellings of earlier versions,
such as --text_files and --output_dir, are still accepted).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from hf_rope_ext.arguments import argument_parser
from hf_rope_ext.training import add_finetune_arguments, config_from_args, finetune
from hf_rope_ext.training.checkpoint import latest_checkpoint
from hf_rope_ext.training.model import needs_load_patched


def build_parser() -> argparse.ArgumentParser:
    parser = argument_parser(__doc__.splitlines()[0])
    add_finetune_arguments(parser)
    return parser


def report(line: str) -> None:
    """Print ``line`` to stderr on the main process only: under `accelerate launch` every process
    meets the same bad input (the checks are the same everywhere), and the user wants it once."""
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)  # refuses dataset-only flags given with --text-files
        summary = finetune(config)
    except (ValueError, TypeError, OSError) as error:  # bad input (settings, a missing file, an unreadable dataset)
        report(f"error: {error}")
        return 2
    except FloatingPointError as error:  # the loss became nan/inf: a failed run, not bad input
        report(f"error: {error}")
        return 1
    except KeyboardInterrupt:  # Ctrl-C: one line, not the traceback of wherever it landed
        latest = latest_checkpoint(Path(args.output_dir) / "checkpoints")
        kept = (f"the checkpoints saved so far are kept in {args.output_dir}; rerun the same command with --resume to "
                f"go on from the last one ({latest.name})" if latest is not None else
                "no checkpoint had been written yet (--save-steps); rerun the command without --resume to start again")
        report(f"\ninterrupted: {kept}.")
        return 130
    if summary:  # the main process
        keys = ("method", "scale", "target_length", "pose", "steps", "tokens_seen", "tokens_per_second", "final_loss", "wall_time_s")
        print(json.dumps({key: summary[key] for key in keys}, indent=2))
        print(f"Adapter: {config.output_dir}/adapter")
        if summary["merged_dir"] and needs_load_patched(summary["method"]):
            print(f"Merged model: {config.output_dir}/merged (load it with hf_rope_ext.hub.load_patched: "
                  f"{summary['method']} patches attention, which plain from_pretrained does not rebuild)")
        elif summary["merged_dir"]:
            print(f"Merged model: {config.output_dir}/merged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
