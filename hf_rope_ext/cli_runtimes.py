"""``hf-rope-ext runtimes``: print the vLLM and llama.cpp settings of a patch (:mod:`hf_rope_ext.runtimes`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from .hub import read_checked_config
from .methods import get_method
from .runtimes import describe_patch, runtime_settings


def _parse_param(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--param takes KEY=VALUE (e.g. beta_fast=32), got {text!r}.")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "runtimes",
        help="print the vLLM and llama.cpp settings equivalent to a patch",
        description=(
            "Print vLLM (--hf-overrides, --max-model-len) and llama.cpp (--rope-scaling ... flags, GGUF keys) settings "
            "for a patched checkpoint (--model-dir), for a patch of a base model (--model-dir plus --method/--scale), "
            "or for a patch given by numbers (--method, --scale, --original-context, --rope-theta, --rotary-dim)."
        ),
    )
    parser.add_argument("--model-dir", help="checkpoint folder or Hub id (its config.json is read)")
    parser.add_argument("--method", help="RoPE method (hf-rope-ext methods lists them)")
    parser.add_argument("--scale", type=float, help="context multiplier (> 1)")
    parser.add_argument("--original-context", type=int, help="context the model was trained on")
    parser.add_argument("--rope-theta", type=float, help="RoPE base of the model (without --model-dir)")
    parser.add_argument("--rotary-dim", type=int, help="rotated dimensions per head (without --model-dir)")
    parser.add_argument("--model-type", help="transformers model_type, for GGUF key names (default: from the config)")
    parser.add_argument("--steps-per-doubling", type=int, help="length-dependent methods: frequency steps per doubling")
    parser.add_argument("--param", action="append", type=_parse_param, default=[], metavar="KEY=VALUE",
                        help="a method parameter, e.g. --param beta_fast=32 (repeatable)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.set_defaults(handler=_runtimes_command)


def _runtimes_command(args: argparse.Namespace) -> int:
    try:
        return _runtimes(args)
    except TypeError as error:  # a parameter of the wrong type (--param beta_fast=abc): bad input too
        raise ValueError(str(error)) from None


def _runtimes(args: argparse.Namespace) -> int:
    params = dict(args.param)
    if args.steps_per_doubling is not None:
        params["steps_per_doubling"] = args.steps_per_doubling
    if args.model_dir:
        if args.rope_theta is not None or args.rotary_dim is not None:
            raise SystemExit("--rope-theta/--rotary-dim describe a model without --model-dir; give one or the other.")
        config = read_checked_config(args.model_dir)
        if args.original_context is not None:
            params["original_max_length"] = args.original_context
        settings = runtime_settings(config, args.method, args.scale, model_type=args.model_type, **params)
        # Runtimes cannot load a checkpoint with one of this package's own rope types.
        model = args.model_dir if args.method or get_method(settings.method).transformers_rope_type else "BASE_MODEL"
    else:
        missing = [flag for flag, value in (("--method", args.method), ("--scale", args.scale),
                   ("--original-context", args.original_context), ("--rope-theta", args.rope_theta),
                   ("--rotary-dim", args.rotary_dim)) if value is None]
        if missing:
            raise SystemExit(f"Without --model-dir, give {', '.join(missing)}.")
        patch = describe_patch(args.method, args.scale, original_max_length=args.original_context,
                               rope_theta=args.rope_theta, rotary_dim=args.rotary_dim, **params)
        settings = runtime_settings(patch, model_type=args.model_type)
        model = "MODEL"
    print(json.dumps(settings.to_dict(), indent=2) if args.json else settings.format(model=model))
    return 0
