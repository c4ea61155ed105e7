"""The ``hf-rope-ext`` command line.

Each subcommand lives in the module that implements it; that module exposes
``add_parser(subparsers)``, which registers the subcommand and sets ``handler`` (a function
taking the parsed arguments and returning an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from .arguments import ArgumentParser  # each option given once

# subcommand -> module providing add_parser(subparsers)
SUBCOMMANDS = {
    "methods": "hf_rope_ext.cli",
    "runtimes": "hf_rope_ext.cli_runtimes",
    "card": "hf_rope_ext.model_card",
    "eval": "hf_rope_ext.evaluation.cli",
    "demo": "hf_rope_ext.evaluation.cli",
    "auto": "hf_rope_ext.auto",
}


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("methods", help="list the RoPE scaling methods")
    parser.set_defaults(handler=_list_methods)


def _list_methods(args: argparse.Namespace) -> int:
    from . import get_method, list_methods

    for name, summary in list_methods().items():
        kind = "length-dependent" if get_method(name).length_dependent else "static"
        print(f"{name:<15} {kind:<17} {summary}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="hf-rope-ext", description="Extend the context of RoPE language models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in dict.fromkeys(SUBCOMMANDS.values()):
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:  # building the parser imports each subcommand (torch, transformers): seconds Ctrl-C can land in
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # huggingface_hub prints its records with its own handler and still passes them on to the root
    # handler above, so each would show twice. Keep them to its handler, as transformers does.
    logging.getLogger("huggingface_hub").propagate = False
    try:
        return args.handler(args)
    except (ValueError, TypeError, OverflowError, OSError, ImportError) as error:
        # Bad input (the library's errors name the problem and the fix; TypeError for a value of
        # the wrong type) or a missing file, folder or connection: one line, no traceback.
        # ValueError covers transformers' invalid repo ids. --verbose logs the traceback too.
        logging.getLogger(__name__).debug("Traceback of the error below:", exc_info=True)
        print(f"error: {one_line(error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, not the traceback of wherever it landed
        print("interrupted", file=sys.stderr)
        return 130


def one_line(error: BaseException) -> str:
    """An exception's message on one line (some libraries' messages span several)."""
    return " ".join(str(error).split()) or type(error).__name__


if __name__ == "__main__":
    sys.exit(main())
