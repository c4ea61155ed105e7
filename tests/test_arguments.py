"""One argument set for every entry point: dash spellings, the older spellings as hidden aliases."""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

import pytest

from hf_rope_ext.arguments import add_option, argument_parser, check_attention_backend, model_label
from hf_rope_ext.cli import build_parser
from hf_rope_ext.training import add_finetune_arguments, config_from_args

REPO = Path(__file__).resolve().parents[1]
UNDERSCORE_OPTION = re.compile(r"--[a-z0-9-]*_")


def example(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def finetune_parser() -> argparse.ArgumentParser:
    parser = argument_parser()
    add_finetune_arguments(parser)
    return parser


def subcommand_help(name: str) -> str:
    parser = build_parser()
    (subparsers,) = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    return subparsers.choices[name].format_help()


def test_hidden_aliases_parse_but_do_not_show():
    parser = argument_parser()
    add_option(parser, "--text-files", "--text-file", nargs="+")
    assert parser.parse_args(["--text_files", "a", "b"]).text_files == ["a", "b"]
    assert parser.parse_args(["--text-file", "a"]).text_files == ["a"]
    help_text = parser.format_help()
    assert "--text-files" in help_text and "--text_files" not in help_text and "--text-file " not in help_text
    with pytest.raises(ValueError, match="dashes"):
        add_option(parser, "--output_dir")


def test_finetune_old_and_new_spellings_give_the_same_config(tmp_path):
    new = ["--model", "m", "--output-dir", str(tmp_path), "--text-files", "a.txt", "b.txt", "--scale", "4", "--pose",
           "--lora-rank", "8", "--no-shuffle", "--attn-implementation", "eager", "--lora-target-modules", "q_proj", "v_proj"]
    old = ["--model", "m", "--output_dir", str(tmp_path), "--text_files", "a.txt", "b.txt", "--scale", "4", "--pose",
           "--lora_rank", "8", "--no_shuffle", "--attn_implementation", "eager", "--lora_target_modules", "q_proj", "v_proj"]
    parser = finetune_parser()
    config = config_from_args(parser.parse_args(new))
    assert config == config_from_args(parser.parse_args(old))
    assert config.text_files == ["a.txt", "b.txt"] and config.output_dir == str(tmp_path)
    assert config.pose is True and config.shuffle is False and config.lora_rank == 8
    assert config.lora_target_modules == ["q_proj", "v_proj"]
    # the dataclass defaults, through the command line
    defaults = config_from_args(parser.parse_args(["--model", "m", "--output-dir", "o", "--scale", "2"]))
    assert defaults.text_files is None and defaults.save_merged is True and defaults.dataset_split == "train"
    assert config_from_args(parser.parse_args(["--model", "m", "--output-dir", "o", "--scale", "2", "--pose", "false"])).pose is False


@pytest.mark.parametrize("name", ["eval", "demo", "card", "auto",
                                  pytest.param("runtimes", id="runtimes-cli")])  # id "runtimes": the real-runtime mark
def test_cli_help_shows_dash_spellings_only(name):
    help_text = subcommand_help(name)
    assert not UNDERSCORE_OPTION.findall(help_text), UNDERSCORE_OPTION.findall(help_text)
    if name not in ("card", "runtimes"):
        assert "--text-files" in help_text and "--text-file " not in help_text


def test_eval_accepts_every_spelling_of_text_files():
    parser = build_parser()
    for spelling in ("--text-files", "--text-file", "--text_file", "--text_files"):
        args = parser.parse_args(["eval", spelling, "a.txt", "--output_dir", "out"])
        assert args.text_file == [Path("a.txt")] and args.output_dir == Path("out")


def test_finetune_help_shows_dash_spellings_only():
    help_text = finetune_parser().format_help()
    assert not UNDERSCORE_OPTION.findall(help_text), UNDERSCORE_OPTION.findall(help_text)


@pytest.mark.parametrize("name", ["eval_long_context", "run_results_table"])
def test_examples_accept_the_old_spellings(name, capsys):
    module = example(name)
    args = module.parse_args(["--text_file", "book.txt", "--output_dir", "out", "--ppl_lengths", "4096",
                              "--steps_per_doubling", "exact", "--attn_implementation", "eager"])
    assert module.parse_args(["--text-files", "book.txt", "--output-dir", "out", "--ppl-lengths", "4096",
                              "--steps-per-doubling", "exact", "--attn-implementation", "eager"]) == args
    assert args.text_files == [Path("book.txt")] and args.attn_implementation == "eager"
    with pytest.raises(SystemExit):
        module.parse_args(["--help"])
    help_text = capsys.readouterr().out
    assert "--text-files" in help_text and not UNDERSCORE_OPTION.findall(help_text)


def test_one_alias_map_and_backend_check():
    assert model_label("SmolLM2") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert model_label("org/name") == "org/name"
    check_attention_backend("sdpa")  # nothing to check
    if importlib.util.find_spec("flash_attn") is None:
        with pytest.raises(ValueError, match="flash_attn"):
            check_attention_backend("flash_attention_2")


def test_device_is_normalised_and_checked_before_loading():
    import torch

    from hf_rope_ext.arguments import check_device

    assert check_device(" CPU ") == "cpu" and check_device("cpu:0") == "cpu:0" and check_device(None) is None
    for device, message in (("nonsense", "--device nonsense is not a device torch knows"),
                            ("auto", "--device-map auto")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            check_device(device)
    if not torch.backends.mps.is_available():
        with pytest.raises(ValueError, match="MPS .* is not available; use --device cpu"):
            check_device("mps")
    if torch.cuda.is_available():
        assert check_device("CUDA") == "cuda"
        count = torch.cuda.device_count()
        with pytest.raises(ValueError, match=f"has {count} CUDA device"):
            check_device(f"cuda:{count}")
    else:
        with pytest.raises(ValueError, match="--device CUDA was asked for but CUDA is not available"):
            check_device("CUDA")


def test_device_types_this_package_does_not_run_on_are_refused():
    """torch parses xla, xpu, meta, ... as devices; loading onto them ended in a traceback."""
    from hf_rope_ext.arguments import check_device

    for device, message in (("xla", "--device xla: xla devices are not supported; use cpu, cuda, cuda:N or mps"),
                            ("xpu:0", "--device xpu:0: xpu devices are not supported"),
                            ("meta", "--device meta: meta devices are not supported"),
                            ("cpu:5", "--device cpu:5: there is one CPU device; use --device cpu")):  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(message)):
            check_device(device)


def _refused_at_parsing(parse, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(lines) == 1, lines
    return lines[0]


EMPTY_VALUES = {
    "eval --output-dir=": ["eval", "--model", "m", "--text-files", "book.txt", "--methods", "yarn", "--output-dir="],
    "auto --text-files=": ["auto", "--model", "m", "--text-files=", "--scale", "4"],
    "auto --model=": ["auto", "--model=", "--text-files", "book.txt", "--scale", "4"],
    "auto --model ''": ["auto", "--model", "", "--text-files", "book.txt", "--scale", "4"],
    "card --eval-dir=": ["card", "--model-dir", "m", "--base-model", "org/base", "--eval-dir="],
    "card --license=": ["card", "--model-dir", "m", "--base-model", "org/base", "--license="],
    "eval --device= ": ["eval", "--model", "m", "--text-files", "book.txt", "--output-dir", "out", "--device= "],
}  # fmt: skip


@pytest.mark.parametrize("case", list(EMPTY_VALUES))
def test_an_empty_path_or_name_is_refused_when_parsed(case, tmp_path, monkeypatch, capsys):
    """`--output-dir=` was Path("") = the current folder: eval wrote its results there."""
    monkeypatch.chdir(tmp_path)
    line = _refused_at_parsing(build_parser().parse_args, EMPTY_VALUES[case], capsys)
    flag = case.split()[1].rstrip("=")
    assert re.search(f"argument {flag}.*: the value is empty; give one", line), line
    assert list(tmp_path.iterdir()) == []


def test_benchmark_refuses_an_empty_output_dir(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    line = _refused_at_parsing(example("benchmark_speed").parse_args, ["--output-dir="], capsys)
    assert "argument --output-dir" in line and "the value is empty" in line
    assert example("benchmark_speed").parse_args(["--output-dir", "x"]).decode_step_methods == []


def test_a_file_given_as_the_model_is_refused_naming_the_fix(tmp_path, capsys):
    (tmp_path / "book.txt").write_text("w1 w2")
    line = _refused_at_parsing(build_parser().parse_args, ["auto", "--model", str(tmp_path / "book.txt"),
                                                           "--text-files", "x", "--scale", "4"], capsys)  # fmt: skip
    assert f"{tmp_path / 'book.txt'} is a file; pass the checkpoint folder (or a Hub id)" in line


def test_a_huggingface_hub_warning_is_printed_once(tmp_path):
    """huggingface_hub prints with its own handler; the command line's root handler must not print it again."""
    import subprocess
    import sys

    script = (
        "import logging, sys\n"
        "import hf_rope_ext.cli as cli\n"
        "def noisy(args):\n"
        "    logging.getLogger('huggingface_hub.utils._http').warning('the hub retries')\n"
        "    return 0\n"
        "cli._list_methods = noisy\n"
        "sys.exit(cli.main(['methods']))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("the hub retries") == 1, result.stderr


# -- an option given twice ------------------------------------------------------------------------------

def _cli(*words: str):
    return lambda argv: build_parser().parse_args([*words, *argv])


def _example_parse_args(name: str):
    return lambda argv: example(name).parse_args(argv)


def _example_main(name: str, monkeypatch):
    def parse(argv):  # these build their parser inside main() and read sys.argv
        monkeypatch.setattr("sys.argv", [f"{name}.py", *argv])
        example(name).main()

    return parse


# (entry point, its other required options, the option given twice, its two values); argparse kept the second value.
GIVEN_TWICE = {
    "eval --scales": (_cli("eval"), ["--output-dir", "o"], "--scales", "--scales", "2", "4"),
    "eval --output-dir/--output_dir": (_cli("eval"), [], "--output-dir", "--output_dir", "a", "b"),
    "eval --no-progress": (_cli("eval"), ["--output-dir", "o"], "--no-progress", "--no_progress", None, None),
    "demo --scale": (_cli("demo"), [], "--scale", "--scale", "2", "4"),
    "runtimes --method": (_cli("runtimes"), [], "--method", "--method", "yarn", "ntk"),
    "card --model-dir/--model_dir": (_cli("card"), [], "--model-dir", "--model_dir", "a", "b"),
    "auto --max-length": (_cli("auto"), ["--model", "m"], "--max-length", "--max_length", "8", "16"),
    "hf-rope-ext -v/--verbose": (lambda argv: build_parser().parse_args([*argv, "methods"]), [], "-v", "--verbose",
                                 None, None),
    "finetune_lora --output-dir/--output_dir": (lambda argv: example("finetune_lora").build_parser().parse_args(argv),
                                                ["--model", "m", "--text-files", "a"], "--output-dir", "--output_dir",
                                                "a", "b"),
    "finetune_lora --lora-rank": (lambda argv: example("finetune_lora").build_parser().parse_args(argv),
                                  ["--model", "m", "--output-dir", "o"], "--lora-rank", "--lora_rank", "8", "4"),
    "run_results_table --scales": (_example_parse_args("run_results_table"), ["--text-files", "a", "--output-dir", "o"],
                                   "--scales", "--scales", "2", "4"),
    "eval_long_context --ppl-lengths": (_example_parse_args("eval_long_context"),
                                        ["--text-files", "a", "--output-dir", "o"], "--ppl-lengths", "--ppl_lengths",
                                        "4k", "8k"),
    "benchmark_speed --scale": (_example_parse_args("benchmark_speed"), ["--output-dir", "o"], "--scale", "--scale",
                                "2", "4"),
    "compare_configurations --length": ("compare_configurations", ["--text-files", "a", "--scale", "2", "--configs",
                                        "none", "--output-dir", "o"], "--length", "--length", "64", "128"),
    "compare_retrieval --output-dir": ("compare_retrieval", ["--length", "64", "--scale", "2", "--configs", "none"],
                                       "--output-dir", "--output_dir", "a", "b"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(GIVEN_TWICE))
def test_an_option_given_twice_is_refused_naming_it(case, tmp_path, monkeypatch, capsys):
    """argparse kept the last value and dropped the first silently (eval --scales 2 --scales 4 ran scale 4 only)."""
    monkeypatch.chdir(tmp_path)
    parse, required, first, second, value_1, value_2 = GIVEN_TWICE[case]
    if isinstance(parse, str):
        parse = _example_main(parse, monkeypatch)
    twice = [first, *([value_1] if value_1 else []), second, *([value_2] if value_2 else [])]
    line = _refused_at_parsing(parse, [*required, *twice], capsys)
    assert re.search(r"error: .*" + re.escape(second) + r" given twice.*; give it once", line), line
    if second != first:
        assert f"(first as {first})" in line, line
    if "scales" in first or "lengths" in first:  # a list option: how to give several values
        assert f"one comma-separated list ({second} A,B)" in line, line
    assert list(tmp_path.iterdir()) == []  # refused before anything was made


def test_two_options_setting_one_value_are_refused_and_repeatable_options_still_repeat(capsys):
    line = _refused_at_parsing(finetune_parser().parse_args, ["--model", "m", "--output-dir", "o", "--text-files", "a",
                                                              "--shuffle", "--no-shuffle"], capsys)  # fmt: skip
    assert "error: --shuffle and --no-shuffle set the same option; give one of them, once" in line
    line = _refused_at_parsing(finetune_parser().parse_args, ["--model", "m", "--output-dir", "o", "--text-files", "a",
                                                              "--lora-target-modules", "q_proj",
                                                              "--lora-target-modules", "v_proj"], capsys)  # fmt: skip
    assert "give it once, with all its values after it (--lora-target-modules A B)" in line
    # append / extend options are meant to repeat: runtimes --param, --text-files under any spelling
    args = build_parser().parse_args(["runtimes", "--method", "yarn", "--param", "beta_fast=16", "--param", "mscale=1"])
    assert [key for key, _ in args.param] == ["beta_fast", "mscale"]
    args = build_parser().parse_args(["eval", "--output-dir", "o", "--text-files", "a", "--text_file", "b"])
    assert args.text_file == [Path("a"), Path("b")]
    # each parse starts afresh: the same parser parses the same options again
    parser = finetune_parser()
    for _ in range(2):
        assert parser.parse_args(["--model", "m", "--output-dir", "o", "--lora-rank", "8"]).lora_rank == 8


def test_every_subcommand_parser_refuses_an_option_given_twice():
    """Subcommand parsers take the class of the parser they hang on; a new subcommand gets the check too."""
    from hf_rope_ext.arguments import ArgumentParser

    parser = build_parser()
    (subparsers,) = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    assert isinstance(parser, ArgumentParser)
    assert all(isinstance(sub, ArgumentParser) for sub in subparsers.choices.values())


def _dash_spellings_only_parser() -> argparse.ArgumentParser:
    """The reference: argparse's own parser with the same options and no hidden aliases."""
    parser = argparse.ArgumentParser(prog="p")
    parser.add_argument("--text-files", nargs="+", required=True)
    parser.add_argument("--text-field")
    parser.add_argument("--output-dir")
    parser.add_argument("--max-new-tokens", type=int)
    return parser


def _aliased_parser() -> argparse.ArgumentParser:
    parser = argument_parser(prog="p")
    add_option(parser, "--text-files", "--text-file", nargs="+", required=True)
    add_option(parser, "--text-field")
    add_option(parser, "--output-dir")
    add_option(parser, "--max-new-tokens", type=int)
    return parser


@pytest.mark.parametrize("argv", [
    ["--text-files", "a", "--out", "o", "--max", "4"],  # each prefix matches one option and its hidden aliases
    ["--text-files", "a", "--output-d=o"],
    ["--text-fil", "a", "b", "--output-dir", "o"],  # --text-files and its aliases --text-file, --text_files: one option
    ["--text", "a"],  # --text-files or --text-field: ambiguous, named by their shown spellings
    ["--out", "o"],  # the required option missing: named by its shown spelling
    ["--text-files", "a", "--max", "x"],  # a bad value: the option named by its shown spelling
])  # fmt: skip
def test_abbreviations_and_errors_see_only_the_shown_spellings(argv, capsys):
    """argparse took --out as ambiguous between --output-dir and its hidden --output_dir, and its
    errors named every alias (--text-files/--text_files/--text-file); both now read as for a parser
    without the aliases."""
    try:
        expected = vars(_dash_spellings_only_parser().parse_args(argv))
    except SystemExit:
        expected = capsys.readouterr().err.splitlines()[-1]
        assert _refused_at_parsing(_aliased_parser().parse_args, argv, capsys) == expected
    else:
        parsed = vars(_aliased_parser().parse_args(argv))
        parsed.pop("given_options")  # what add_option records besides
        assert parsed == expected


def test_a_prefix_of_hidden_spellings_only_is_refused_naming_the_shown_ones(capsys):
    """--text_f matches only the hidden --text_files and --text_field: the ambiguity names the options
    as --help shows them."""
    line = _refused_at_parsing(_aliased_parser().parse_args, ["--text_f", "a"], capsys)
    assert line.endswith("error: ambiguous option: --text_f could match --text-files, --text-field")


def test_the_command_line_tools_take_abbreviations_of_their_shown_options(capsys):
    args = build_parser().parse_args(["eval", "--text-files", "a", "--out", "o", "--max", "4"])
    assert args.output_dir == Path("o") and args.max_new_tokens == 4
    assert finetune_parser().parse_args(["--model", "m", "--out", "o", "--scale", "2"]).output_dir == Path("o")
    assert _aliased_parser().parse_args(["--text-files", "a", "--max_new", "4"]).max_new_tokens == 4  # a hidden alias's prefix
    line = _refused_at_parsing(build_parser().parse_args, ["auto", "--model", "m", "--scale", "2"], capsys)
    assert line.endswith("error: the following arguments are required: --text-files"), line
