"""``hf-rope-ext runtimes``: print the vLLM and llama.cpp settings of a patch (:mod:`hf_rope_ext.runtimes`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .arguments import HelpFormatter, add_option, model_label
from .config_io import read_record
from .hub import read_checked_config
from .loading import SMOLLM2_ALIASES, expand_home, resolve_model_path
from .methods import REQUIRED, get_method
from .runtimes import describe_patch, runtime_settings
from .spec import split_method_spec

# Python's spellings of JSON's true/false/null, which users type as often.
_PYTHON_LITERALS = {"True": True, "False": False, "None": None}

# Keys that are not method parameters, and the flag that sets each (--model-dir's config gives
# the model's own RoPE facts).
_FLAG_OF_KEY = {
    "rope_theta": "--rope-theta", "rotary_dim": "--rotary-dim", "partial_rotary_factor": "--rotary-dim",
    "model_type": "--model-type", "original_max_length": "--original-context",
    "original_max_position_embeddings": "--original-context", "scale": "--scale", "factor": "--scale",
    "method": "--method",
}  # fmt: skip
_MODEL_FACTS = ("rope_theta", "rotary_dim", "partial_rotary_factor")


def _check_param_keys(params: dict[str, Any], model_dir: str | None) -> None:
    for key in params:
        if key not in _FLAG_OF_KEY:
            continue
        if key in _MODEL_FACTS and model_dir:
            raise ValueError(
                f"--param {key}: {key} is the model's own, read from the config in {model_dir}; to describe another "
                "model, give --rope-theta and --rotary-dim without --model-dir."
            )
        raise ValueError(f"--param {key}: {key} is not a method parameter; use {_FLAG_OF_KEY[key]}.")


def _parse_param(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--param takes KEY=VALUE (e.g. beta_fast=32), got {text!r}.")
    if value in _PYTHON_LITERALS:
        return key, _PYTHON_LITERALS[value]
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "runtimes",
        formatter_class=HelpFormatter,  # hides the underscore aliases, as the other subcommands do
        help="print the vLLM and llama.cpp settings equivalent to a patch",
        description=(
            "Print vLLM (--hf-overrides, --max-model-len) and llama.cpp (--rope-scaling ... flags, GGUF keys) settings "
            "for a patched checkpoint (--model-dir), for a patch of a base model (--model-dir plus --method/--scale), "
            "or for a patch given by numbers (--method, --scale, --original-context, --rope-theta, --rotary-dim)."
        ),
    )
    add_option(parser, "--model-dir", help="checkpoint folder or Hub id (its config.json is read)")
    add_option(parser, "--method", help="RoPE method (hf-rope-ext methods lists them)")
    add_option(parser, "--scale", type=float, help="context multiplier (> 1)")
    add_option(parser, "--original-context", type=int, help="context the model was trained on")
    add_option(parser, "--rope-theta", type=float, help="RoPE base of the model (without --model-dir)")
    add_option(parser, "--rotary-dim", type=int, help="rotated dimensions per head (without --model-dir)")
    add_option(parser, "--model-type", help="transformers model_type, for GGUF key names (default: from the config)")
    add_option(parser, "--steps-per-doubling", type=int, help="length-dependent methods: frequency steps per doubling")
    add_option(parser, "--param", action="append", type=_parse_param, default=[], metavar="KEY=VALUE",
               help="a method parameter, e.g. --param beta_fast=32 (repeatable)")
    add_option(parser, "--json", action="store_true", help="print JSON instead of text")
    parser.set_defaults(handler=_runtimes_command)


def _runtimes_command(args: argparse.Namespace) -> int:
    try:
        return _runtimes(args)
    except TypeError as error:  # a parameter of the wrong type (--param beta_fast=abc): bad input too
        raise ValueError(str(error)) from None


def _params(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """The --param pairs as a dict; a key given twice is contradictory input, not "last one wins"."""
    params: dict[str, Any] = {}
    for key, value in pairs:
        if key in params:
            raise ValueError(f"--param {key} is given twice ({params[key]!r} and {value!r}); give it once.")
        params[key] = value
    return params


def _check_required_params(method: str | None, params: dict[str, Any]) -> None:
    """Name the --param flag a method needs (the library's message names patch_model's argument)."""
    if method is None:
        return
    name, _ = split_method_spec(method)
    if not name:  # "+logn" alone: runtime_settings names the problem
        return
    missing = [key for key, value in get_method(name).defaults.items() if value is REQUIRED and key not in params]
    if missing:
        flags = " ".join(f"--param {key}=VALUE" for key in missing)
        raise ValueError(f"--method {method} needs {flags} (VALUE in JSON, e.g. [1.0,1.5,2.0] for a list).")


def _runtimes(args: argparse.Namespace) -> int:
    params = _params(args.param)
    _check_param_keys(params, args.model_dir)
    _check_required_params(args.method, params)
    if args.steps_per_doubling is not None:
        params["steps_per_doubling"] = args.steps_per_doubling
    if args.model_dir:
        if args.rope_theta is not None or args.rotary_dim is not None:
            raise ValueError("--rope-theta/--rotary-dim describe a model without --model-dir; give one or the other.")
        if Path(expand_home(args.model_dir)).is_file():  # vLLM and llama.cpp take the folder, not its config.json
            raise ValueError(
                f"--model-dir {args.model_dir} is a file; pass the checkpoint folder that holds it "
                f"({Path(expand_home(args.model_dir)).parent})."
            )
        # smollm2 -> the cached checkpoint, as every other command reads it (not a Hub id).
        alias = args.model_dir.lower() in SMOLLM2_ALIASES
        config = read_checked_config(resolve_model_path(args.model_dir) if alias else args.model_dir)
        record = read_record(config)
        if record is not None and (args.method or args.scale is not None or params or args.original_context is not None):
            raise ValueError(
                f"{args.model_dir} is already patched ({record.get('method')}, scale {record.get('scale')}): run "
                "without --method/--scale/--param/--original-context/--steps-per-doubling for its settings, or pass "
                "the base model's folder to describe another patch."
            )
        if args.original_context is not None:
            params["original_max_length"] = args.original_context
        settings = runtime_settings(config, args.method, args.scale, model_type=args.model_type, **params)
        # Runtimes cannot load a checkpoint with one of this package's own rope types.
        model = model_label(args.model_dir) if args.method or get_method(settings.method).transformers_rope_type \
            else "BASE_MODEL"
    else:
        missing = [flag for flag, value in (("--method", args.method), ("--scale", args.scale),
                   ("--original-context", args.original_context), ("--rope-theta", args.rope_theta),
                   ("--rotary-dim", args.rotary_dim)) if value is None]
        if missing:
            raise ValueError(f"Without --model-dir, give {', '.join(missing)}.")
        patch = describe_patch(args.method, args.scale, original_max_length=args.original_context,
                               rope_theta=args.rope_theta, rotary_dim=args.rotary_dim, **params)
        settings = runtime_settings(patch, model_type=args.model_type)
        model = "MODEL"
    print(json.dumps(settings.to_dict(), indent=2) if args.json else settings.format(model=model))
    return 0
