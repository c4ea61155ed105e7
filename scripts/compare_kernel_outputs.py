"""Last hidden states of the default patch over seeded random tokens: the two-regime kernel against
the partial-softmax tiles (``HF_ROPE_EXT_TWO_REGIME_KERNEL=0``) in this checkout, and against the
hidden states another checkout saved, so that a change to the kernel path can be checked end to
end on a GPU (bf16, ``sdpa``):

    PYTHONPATH=/old/checkout python scripts/compare_kernel_outputs.py /tmp/speed_model --save /tmp/old.safetensors
    PYTHONPATH=. python scripts/compare_kernel_outputs.py /tmp/speed_model --against /tmp/old.safetensors

MODEL is a checkpoint folder (``scripts/make_speed_model.py`` writes one with SmolLM2's shapes);
the scale is ``--tokens`` over its native context. Prints each path's time for the forward of the
decoder body, the checksum of the hidden states beyond the native context, and the largest
differences.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from hf_rope_ext import patch_model
from hf_rope_ext.attention import TWO_REGIME_SWITCH

try:  # each option given once; --save runs with another checkout on PYTHONPATH, which may predate it
    from hf_rope_ext.arguments import ArgumentParser
except ImportError:
    from argparse import ArgumentParser


def main() -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="a checkpoint folder")
    parser.add_argument("--tokens", type=int, default=65536, help="tokens of the forward (beyond the native context)")
    parser.add_argument("--save", type=Path, help="write this checkout's hidden states here (a new file)")
    parser.add_argument("--against", type=Path, help="compare with hidden states another checkout saved")
    args = parser.parse_args()
    if not (args.model / "config.json").is_file():
        parser.error(f"{args.model} is not a checkpoint folder (no config.json)")
    if args.save is not None and args.save.exists():
        parser.error(f"{args.save} exists; give a new file name")
    if args.save is not None and not args.save.parent.is_dir():  # else the result is lost after the forwards
        parser.error(f"--save {args.save}: the folder {args.save.parent} does not exist; make it first")
    if args.against is not None and not args.against.is_file():
        parser.error(f"{args.against} is not a file")
    config = AutoConfig.from_pretrained(args.model)
    native = config.max_position_embeddings
    if args.tokens <= native:
        parser.error(f"--tokens must exceed the model's native context {native}")
    other = None
    if args.against is not None:  # read and checked before the model loads and the forwards run
        shape = (args.tokens - native, config.hidden_size)
        try:
            other = load_file(args.against).get("hidden")
        except SafetensorError as error:
            parser.error(f"--against {args.against} is not a safetensors file ({error}); give a file --save wrote")
        if other is None or tuple(other.shape) != shape:
            parser.error(f"--against {args.against} holds no hidden states of shape {shape} (got "
                         f"{None if other is None else tuple(other.shape)}); save it with the same model and --tokens")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, attn_implementation="sdpa").to(device)
    patch_model(model, scale=args.tokens / native)
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)

    def hidden() -> tuple[torch.Tensor, float]:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            states = model.model(ids).last_hidden_state[0, native:].float()
        if device == "cuda":
            torch.cuda.synchronize()
        return states, time.perf_counter() - start

    hidden()  # compiles the kernel
    kernel, seconds = hidden()
    print(f"default x{args.tokens / native:g}, {args.tokens} tokens on {device}: body forward {seconds:.3f} s, "
          f"checksum {float(kernel.double().abs().sum()):.4f}, largest value {float(kernel.abs().max()):.3e}")
    if other is not None:
        other = other.to(device)
        print(f"  against {args.against}: largest difference {float((kernel - other).abs().max()):.3e}, "
              f"bitwise equal {torch.equal(kernel, other)}")
    if args.save is not None:
        save_file({"hidden": kernel.contiguous().cpu()}, args.save)
    previous = os.environ.get(TWO_REGIME_SWITCH)
    os.environ[TWO_REGIME_SWITCH] = "0"
    try:
        tiles, seconds = hidden()
    finally:
        if previous is None:
            del os.environ[TWO_REGIME_SWITCH]
        else:
            os.environ[TWO_REGIME_SWITCH] = previous
    print(f"  partial-softmax tiles (kernel off): body forward {seconds:.3f} s, largest difference to the kernel "
          f"{float((kernel - tiles).abs().max()):.3e}")


if __name__ == "__main__":
    main()
