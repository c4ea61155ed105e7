"""examples/eval_long_context.py and examples/benchmark_speed.py: the documented command runs, bad
input stops with one line and exit code 2 before the model loads, and outputs are not lost.

(Their argument spellings are tested in test_arguments.py, the decode-step benchmark in
test_attention.py.)"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import load_repo_script, make_model
from test_bad_input import _word_tokenizer

from hf_rope_ext.cli import build_parser
from hf_rope_ext.evaluation.records import read_results

REPO = Path(__file__).resolve().parents[1]


def example(name: str):
    return load_repo_script("examples", name)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama (native context 32) with a word tokenizer, a 400-token book and a plain file."""
    folder = tmp_path_factory.mktemp("examples")
    make_model("llama").save_pretrained(folder / "model")
    _word_tokenizer().save_pretrained(folder / "model")
    (folder / "book.txt").write_text(" ".join(f"w{i % 100}" for i in range(400)))
    (folder / "a-file").write_text("x")
    return folder


def documented_command(module) -> list[str]:
    """The command of the example's docstring, as arguments."""
    text = module.__doc__.split("::", 1)[1].split("\n\n")[1]
    return shlex.split(text.replace("\\\n", " "))[1:]  # without "python"


def _with(command: list[str], **values: str) -> list[str]:
    """``command`` with the values of some options replaced (``text_files="x"`` for --text-files)."""
    command = list(command)
    for name, value in values.items():
        index = command.index("--" + name.replace("_", "-"))
        command[index + 1] = value
    return command


def test_eval_example_runs_its_documented_command_without_steps_per_doubling(tiny):
    module = example("eval_long_context")
    command = documented_command(module)
    assert command[0] == "examples/eval_long_context.py" and "--steps-per-doubling" not in command
    output = tiny / "eval"
    command = _with(command, text_files=str(tiny / "book.txt"), ppl_lengths="48,64", retrieval_lengths="160",
                    output_dir=str(output))  # the tiny model's scale: native context 32, passkey prompts of 128+
    result = subprocess.run([sys.executable, *command, "--model", str(tiny / "model")], cwd=REPO,
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_results(output)
    assert {(r["kind"], r["method"]) for r in records} == {("perplexity", "none"), ("perplexity", "yarn"),
                                                           ("retrieval", "none"), ("retrieval", "yarn")}
    # The default frequency steps are hf-rope-ext eval's.
    eval_args = build_parser().parse_args(["eval", "--text-files", "b.txt", "--output-dir", "o"])
    assert module.parse_args(["--text-files", "b.txt", "--output-dir", "o"]).steps_per_doubling == (
        eval_args.steps_per_doubling)


def test_eval_example_evaluates_a_save_patched_checkpoint_from_its_base_rope(tiny, tmp_path, capsys):
    """A checkpoint saved from a patched model is measured from its base RoPE, as `hf-rope-ext eval`
    does: the same records as the base checkpoint's (plain loading would take the patched RoPE for
    the model's own and label it 'none')."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_rope_ext import patch_model
    from hf_rope_ext.hub import save_patched

    model = AutoModelForCausalLM.from_pretrained(tiny / "model")
    patch_model(model, scale=4, method="yarn")
    save_patched(model, tmp_path / "patched")
    AutoTokenizer.from_pretrained(tiny / "model").save_pretrained(tmp_path / "patched")
    module = example("eval_long_context")
    options = ["--text-files", str(tiny / "book.txt"), "--ppl-lengths", "64", "--scales", "2",
               "--methods", "none,yarn", "--retrieval-tasks", "", "--device", "cpu"]  # fmt: skip
    for name, folder in (("base", tiny / "model"), ("patched", tmp_path / "patched")):
        assert module.main([*options, "--model", str(folder), "--output-dir", str(tmp_path / name)]) == 0
    capsys.readouterr()
    keys = ("method", "scale", "native_context", "rope_fingerprint", "ppl")
    base, saved = read_results(tmp_path / "base"), read_results(tmp_path / "patched")
    assert [[r[k] for k in keys] for r in saved] == [[r[k] for k in keys] for r in base]
    assert {r["native_context"] for r in saved} == {32}


def test_eval_example_takes_the_eval_commands_list_spellings(tiny):
    args = example("eval_long_context").parse_args(
        ["--text-files", "b.txt", "--output-dir", "o", "--ppl-lengths", "4k,9216", "--scales", "2,4",
         "--methods", "none, yarn", "--retrieval-tasks", ""])  # fmt: skip
    assert args.ppl_lengths == [4096, 9216] and args.scales == [2.0, 4.0] and args.methods == ["none", "yarn"]
    assert args.retrieval_tasks == []


def replacing_options(argv: list[str], extra: list[str]) -> list[str]:
    """``argv`` and then ``extra``, less the options of ``argv`` (with their values) that ``extra``
    gives again: the parsers refuse an option given twice, so a case's option replaces the base
    one. Spellings match with ``_`` read as ``-``; option values here never start with ``--``."""

    def name(part: str) -> str:
        return part.split("=", 1)[0].replace("_", "-")

    given = {name(part) for part in extra if part.startswith("--")}
    kept, dropping_values = [], False
    for part in argv:
        if part.startswith("--"):
            dropped = name(part) in given
            dropping_values = dropped and "=" not in part  # its values follow it
            if dropped:
                continue
        elif dropping_values:
            continue
        kept.append(part)
    return [*kept, *extra]


def _refused_before_loading(module, argv, monkeypatch, capsys) -> str:
    """Run ``module.main(argv)``: exit code 2, no traceback, the model never loaded; the error line."""

    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was refused")

    for name in ("load_model", "load_for_evaluation", "load_base_model"):  # the loader the example calls
        if hasattr(module, name):
            monkeypatch.setattr(module, name, load_model)
    try:
        code = module.main() if argv is None else module.main(argv)  # None: sys.argv
    except SystemExit as error:  # argparse
        code = error.code
    assert code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("extra, message", [
    (["--scales", "x"], "argument --scales: expected comma-separated numbers"),
    (["--ppl-lengths", "4q"], "--ppl-lengths: expected comma-separated integers (e.g. 4096,8192 or 4k,8k)"),
    (["--methods", "yarnn"], "Unknown method(s) 'yarnn'"),
    (["--text-files", "missing.txt"], "Text file not found: missing.txt. Pass an existing file with --text-files."),
    (["--output-dir", "{tiny}/a-file/x"], "--output-dir {tiny}/a-file/x cannot be created: {tiny}/a-file is a file"),
    (["--output-dir", "{tiny}/a-file"], "is a file, not a folder"),
    (["--steps-per-doubling", "0"], "must be a positive integer or 'exact'"),
])  # fmt: skip
def test_eval_example_bad_input_is_one_line_and_exit_2_before_loading(tiny, extra, message, monkeypatch, capsys):
    module = example("eval_long_context")
    argv = replacing_options(["--text-files", str(tiny / "book.txt"), "--output-dir", str(tiny / "unused"),
                              "--ppl-lengths", "64", "--retrieval-tasks", ""],
                             [part.format(tiny=tiny) for part in extra])  # fmt: skip
    assert message.format(tiny=tiny) in _refused_before_loading(module, argv, monkeypatch, capsys)
    assert not (tiny / "unused").exists()  # made only once the input passed


@pytest.mark.parametrize("extra, message", [
    (["--forward-methods", "yarnn"], "Unknown RoPE method 'yarnn'. Did you mean 'yarn'?"),
    (["--scale", "1"], "--scale=1 leaves the model unchanged"),
    (["--forward-scale", "0.5"], "--forward-scale=0.5 is below 1"),
    (["--forward-repeats", "0"], "--forward-repeats must be at least 1, got 0"),
    (["--decode-repeats", "0"], "--decode-repeats must be at least 1, got 0"),
    (["--forward-methods", ""], "--forward-methods names no method"),
    (["--skip-forward", "--skip-decode"], "--skip-forward and --skip-decode leave nothing to measure; drop one of them "
                                          "or give --decode-step-methods"),
    (["--output-dir", "{tiny}/a-file/x"], "--output-dir {tiny}/a-file/x cannot be created: {tiny}/a-file is a file"),
])  # fmt: skip
def test_benchmark_bad_input_is_one_line_and_exit_2_before_loading(tiny, extra, message, monkeypatch, capsys):
    module = example("benchmark_speed")
    argv = replacing_options(["--output-dir", str(tiny / "unused")], [part.format(tiny=tiny) for part in extra])
    assert message.format(tiny=tiny) in _refused_before_loading(module, argv, monkeypatch, capsys)


def test_benchmark_writes_speed_json_atomically_into_a_folder_made_first(tiny, monkeypatch, capsys):
    module = example("benchmark_speed")
    output = tiny / "bench" / "nested"
    written, real_write, real_load = [], module.atomic_write_json, module.load_base_model

    def atomic_write_json(path, data):
        written.append(Path(path).name)
        real_write(path, data)

    def load_model(*args, **kwargs):
        assert output.is_dir()  # made before the model loads, not after the benchmark ran
        return real_load(*args, **kwargs)

    monkeypatch.setattr(module, "atomic_write_json", atomic_write_json)
    monkeypatch.setattr(module, "load_base_model", load_model)
    assert module.main(["--model", str(tiny / "model"), "--output-dir", str(output), "--device", "cpu",
                        "--forward-tokens", "40", "--forward-repeats", "1", "--forward-methods", "yarn,ntk",
                        "--decode-repeats", "1", "--decode-new-tokens", "2", "--original-context", "16"]) == 0
    report = json.loads((output / "speed.json").read_text())
    assert set(report["forward"]) == {"tokens", "none", "yarn", "ntk"} and len(report["decode"]["shapes"]) == 4
    assert written[-1] == "speed.json" and set(written[:-1]) == {"decode_rounds.json"}
    assert "Forward pass, 40 tokens" in capsys.readouterr().out


@pytest.mark.parametrize("earlier", ["speed.json", "decode_rounds.json"])
def test_benchmark_refuses_a_folder_of_an_earlier_run_before_loading(tiny, earlier, monkeypatch, capsys):
    """A second run into a folder would replace the first run's results whole (even one that
    measures nothing): refused, the earlier file untouched."""
    module = example("benchmark_speed")
    output = tiny / f"earlier-{earlier}"
    output.mkdir()
    (output / earlier).write_text('{"forward": {"tokens": 40}}')
    argv = ["--output-dir", str(output), "--skip-decode", "--forward-methods", "yarn"]
    line = _refused_before_loading(module, argv, monkeypatch, capsys)
    assert line == f"error: {output / earlier} holds the results of an earlier run; give another --output-dir " \
                   "(nothing is overwritten)."
    assert [p.name for p in output.iterdir()] == [earlier] and (output / earlier).read_text() == \
        '{"forward": {"tokens": 40}}'


@pytest.mark.parametrize("methods, named", [
    ("yarn,self-extend", "self-extend"), ("dual-chunk", "dual-chunk"), ("self-extend-yarn", "self-extend-yarn"),
    ("ntk,yarn+logn", "yarn+logn"),
])  # fmt: skip
def test_benchmark_refuses_attention_level_forwards_inside_the_native_context(tiny, methods, named, monkeypatch,
                                                                              capsys):
    """Up to the native context (32 tokens, conftest's tiny Llama) attention-level methods and log-n
    attention leave attention as it is: the ratio would time a no-op. Refused before any forward,
    as --decode-step-tokens inside the native context is; one token beyond passes."""
    module = example("benchmark_speed")
    timed = []
    monkeypatch.setattr(module, "forward_benchmark", lambda model, ids, *rest: timed.append(ids.shape[1]) or {})
    argv = ["--model", str(tiny / "model"), "--device", "cpu", "--skip-decode", "--forward-repeats", "1",
            "--forward-methods", methods, "--forward-scale", "2"]  # fmt: skip
    output = tiny / f"native-{named}"
    assert module.main([*argv, "--forward-tokens", "32", "--output-dir", str(output)]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: --forward-tokens 32 is within the model's native context of 32 tokens, where the attention of "
        f"{named} is the unpatched one (the ratio would time a no-op); give more than 32.")
    assert timed == [] and not (output / "speed.json").exists()
    assert module.main([*argv, "--forward-tokens", "33", "--output-dir", str(output)]) == 0
    assert timed == [33]


def test_benchmark_times_static_methods_inside_the_native_context(tiny, monkeypatch):
    """yarn changes the frequencies at every length: not refused at 32 tokens."""
    module = example("benchmark_speed")
    timed = []
    monkeypatch.setattr(module, "forward_benchmark", lambda model, ids, *rest: timed.append(ids.shape[1]) or {})
    assert module.main(["--model", str(tiny / "model"), "--device", "cpu", "--skip-decode", "--forward-tokens", "32",
                        "--forward-methods", "yarn,ntk", "--output-dir", str(tiny / "native-static")]) == 0
    assert timed == [32]


def test_compare_configurations_refuses_a_second_text_in_one_folder(tiny, monkeypatch, capsys):
    """The table has no text column and "time vs none" divides by the folder's `none` row: a second
    text is refused before the model loads, the first text's results untouched."""
    module = example("compare_configurations")
    other = tiny / "other-book.txt"
    other.write_text(" ".join(f"w{(7 * i) % 100}" for i in range(400)))
    output = tiny / "compare"
    common = ["compare_configurations.py", "--model", str(tiny / "model"), "--length", "64", "--scale", "2",
              "--output-dir", str(output)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", [*common, "--text-files", str(tiny / "book.txt"), "--configs", "none"])
    module.main()
    before = {name: (output / name).read_text() for name in ("results.jsonl", "table.md")}

    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the second text was refused")

    monkeypatch.setattr(module, "load_base_model", load_model)
    monkeypatch.setattr(sys, "argv", [*common, "--text-files", str(other), "--configs", "yarn"])
    with pytest.raises(SystemExit) as stopped:
        module.main()
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"compare_configurations.py: error: {output / 'results.jsonl'} holds results for the text 'book.txt', not "
        "'other-book.txt'; use another --output-dir for this text")
    assert {name: (output / name).read_text() for name in before} == before


@pytest.mark.parametrize("field", ["seconds", "ppl", "config"])
def test_compare_configurations_refuses_a_record_the_table_cannot_show_before_loading(tiny, field, monkeypatch,
                                                                                      capsys):  # fmt: skip
    """A stored record without a field the table reads stops the run before the model loads, not
    with a KeyError after the new forwards were appended."""
    module = example("compare_configurations")
    output = tiny / f"compare-without-{field}"
    common = ["compare_configurations.py", "--model", str(tiny / "model"), "--length", "64", "--scale", "2",
              "--text-files", str(tiny / "book.txt"), "--output-dir", str(output)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", [*common, "--configs", "none"])
    module.main()
    record = json.loads((output / "results.jsonl").read_text())
    del record[field]
    (output / "results.jsonl").write_text(json.dumps(record) + "\n")
    monkeypatch.setattr(sys, "argv", [*common, "--configs", "none;yarn"])
    last = _refused_before_loading(module, None, monkeypatch, capsys)
    assert f"{output / 'results.jsonl'}: record 1 has no" in last and f"(field {field!r}, got None)" in last
    assert (output / "results.jsonl").read_text() == json.dumps(record) + "\n"


@pytest.mark.parametrize("field", ["correct", "depth", "task"])
def test_compare_retrieval_refuses_a_record_the_table_cannot_show_before_loading(tiny, field, monkeypatch, capsys):
    module = example("compare_retrieval")
    output = tiny / f"retrieval-without-{field}"
    output.mkdir()
    record = {"key": "k", "config": "none", "scale": 2.0, "length": 300, "task": "passkey", "depth": 0.5,
              "correct": 1, "trials": [{"answer": "1", "output": "1", "correct": True, "seconds": 0.1}]}
    del record[field]
    (output / "results.jsonl").write_text(json.dumps(record) + "\n")
    monkeypatch.setattr(sys, "argv", ["compare_retrieval.py", "--model", str(tiny / "model"), "--length", "300",
                                      "--scale", "2", "--configs", "none;yarn", "--depths", "0.5", "--trials", "1",
                                      "--output-dir", str(output)])  # fmt: skip
    last = _refused_before_loading(module, None, monkeypatch, capsys)
    assert f"{output / 'results.jsonl'}: record 1 has no" in last and f"(field {field!r}, got None)" in last


@pytest.mark.parametrize("words", [50, 300])  # fewer ids than the 100 skipped; more than the model's 128
def test_benchmark_draws_decode_ids_both_tokenizer_and_model_know(tiny, words, monkeypatch, capsys):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    folder = tiny / f"model-{words}-words"
    make_model("llama").save_pretrained(folder)
    word_level = Tokenizer(WordLevel({"<unk>": 0, **{f"w{i}": i for i in range(1, words)}}, unk_token="<unk>"))
    word_level.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="<unk>", eos_token="<unk>").save_pretrained(folder)
    module = example("benchmark_speed")
    step_ids = []
    real_step = module.decode_step_benchmark
    monkeypatch.setattr(module, "decode_step_benchmark", lambda model, ids, *rest: step_ids.append(ids)
                        or real_step(model, ids, *rest))  # fmt: skip
    assert module.main(["--model", str(folder), "--device", "cpu", "--output-dir", str(folder / "bench"),
                        "--skip-forward", "--decode-repeats", "1", "--decode-new-tokens", "2", "--original-context",
                        "16", "--decode-step-methods", "self-extend", "--decode-step-tokens", "40",
                        "--decode-step-repeats", "1"]) == 0  # fmt: skip
    known = min(words, make_model("llama").config.vocab_size)
    assert step_ids[0].shape == (1, 41) and 0 <= int(step_ids[0].min()) and int(step_ids[0].max()) < known
    assert set(json.loads((folder / "bench" / "speed.json").read_text())) >= {"decode", "decode_step"}


@pytest.mark.parametrize("name", ["compare_configurations", "compare_retrieval"])
@pytest.mark.parametrize("scale, message", [("nan", "--scale must be finite, got nan."),
                                            ("-2", "--scale must be > 1"), ("0.5", "--scale=0.5 is below 1")])
def test_comparisons_refuse_a_nonsense_scale_for_an_unpatched_run_before_loading(tiny, name, scale, message,
                                                                                 monkeypatch, capsys):  # fmt: skip
    """The scale is written to every row and key, `none` rows too."""
    module = example(name)
    output = tiny / f"{name}-scale"
    argv = [f"{name}.py", "--model", str(tiny / "model"), "--length", "200", "--scale", scale, "--configs", "none",
            "--output-dir", str(output)]  # fmt: skip
    if name == "compare_configurations":
        argv += ["--text-files", str(tiny / "book.txt")]
    monkeypatch.setattr(sys, "argv", argv)
    assert message in _refused_before_loading(module, None, monkeypatch, capsys)
    assert not output.exists()


@pytest.mark.parametrize("value", ["0", "banana"])
def test_results_table_example_says_what_steps_per_doubling_takes(value, capsys):
    with pytest.raises(SystemExit) as stopped:
        example("run_results_table").build_parser().parse_args(
            ["--text-files", "b.txt", "--output-dir", "o", "--steps-per-doubling", value])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        f"steps per doubling must be a positive integer or 'exact', got {value!r}.")


@pytest.mark.parametrize("method", ["yarn", "self-extend-yarn"])
def test_comparison_scripts_build_a_saved_patched_checkpoints_configurations_from_its_base_rope(tiny, method,
                                                                                                 monkeypatch):  # fmt: skip
    """A save_patched checkpoint as --model (a fine-tuned merged/ folder, say): `none` is its weights
    unpatched and every configuration is built from the original RoPE, as for the base model's own
    folder. Plain loading recorded the checkpoint's patched RoPE (yarn x2 frequencies, or
    self-extend-yarn's frequencies without its attention) as `none`, or refused the others with a
    fix only Python can apply."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_rope_ext import patch_model
    from hf_rope_ext.hub import save_patched

    checkpoint = tiny / f"saved-{method}"
    if not checkpoint.exists():
        model = AutoModelForCausalLM.from_pretrained(tiny / "model")
        patch_model(model, 2, method)
        save_patched(model, checkpoint, tokenizer=AutoTokenizer.from_pretrained(tiny / "model"))
    fields = ("config", "ppl")
    results = {}
    for name, folder in (("base", tiny / "model"), ("checkpoint", checkpoint)):
        output = tiny / f"compare-{method}-{name}"
        monkeypatch.setattr(sys, "argv", [
            "compare_configurations.py", "--model", str(folder), "--length", "64", "--scale", "2", "--text-files",
            str(tiny / "book.txt"), "--output-dir", str(output), "--configs", "none;yarn;self-extend"])  # fmt: skip
        example("compare_configurations").main()
        records = [json.loads(line) for line in (output / "results.jsonl").read_text().splitlines()]
        results[name] = [{field: record[field] for field in fields} for record in records]
    assert [record["config"] for record in results["base"]] == ["none", "yarn", "self-extend"]
    assert results["checkpoint"] == results["base"]
    retrieval = {}
    for name, folder in (("base", tiny / "model"), ("checkpoint", checkpoint)):
        output = tiny / f"retrieval-{method}-{name}"
        monkeypatch.setattr(sys, "argv", [
            "compare_retrieval.py", "--model", str(folder), "--length", "300", "--scale", "2", "--configs",
            "none;yarn", "--depths", "0.5", "--trials", "1", "--output-dir", str(output)])  # fmt: skip
        example("compare_retrieval").main()
        trials = [json.loads(line) for line in (output / "trials.jsonl").read_text().splitlines()]
        retrieval[name] = [{key: value for key, value in trial.items() if key not in ("model", "seconds")}
                           for trial in trials]  # fmt: skip
    assert len(retrieval["base"]) == 4 and retrieval["checkpoint"] == retrieval["base"]
