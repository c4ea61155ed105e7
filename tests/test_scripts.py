"""scripts/ and the comparison examples: bad input stops with one line and exit code 2 before any slow
work (a build, a model load, a forward), and the GPU shell scripts run from any folder with the
project's interpreter. Shell scripts are run with a recording stand-in for python: nothing is built,
installed or loaded."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import load_repo_script, make_model

REPO = Path(__file__).resolve().parents[1]


def script(name: str):
    return load_repo_script("scripts", name)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama checkpoint (native context 32) and a plain file."""
    folder = tmp_path_factory.mktemp("scripts")
    make_model("llama").save_pretrained(folder / "model")
    (folder / "a-file").write_text("x")
    return folder


def _refused_before_loading(module, argv, monkeypatch, capsys, loader="AutoModelForCausalLM") -> str:
    """Run ``module.main()`` with ``argv``: exit code 2, no traceback, the model never loaded; the error line."""

    class NeverLoaded:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr(module, loader, NeverLoaded)
    monkeypatch.setattr(sys, "argv", [f"{module.__name__}.py", *argv])
    with pytest.raises(SystemExit) as stopped:
        module.main()
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def _recorder(path: Path, log: Path, cuda_check_rc: int = 0) -> Path:
    """An executable that stands in for python: answers the CUDA check (``-c ...``) with
    ``cuda_check_rc`` and records its folder and arguments of every other call in ``log``."""
    path.write_text(
        "#!/bin/bash\n"
        f'if [ "$1" = "-c" ]; then echo "-c $PWD" >> {log}; exit {cuda_check_rc}; fi\n'
        f'echo "$PWD|$*" >> {log}\n'
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _bash(script: Path, *args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if key != "PYTHON"}
    environment.update(env)
    return subprocess.run(["bash", str(script), *args], cwd=cwd, env=environment, capture_output=True, text=True,
                          timeout=60)


# 1. check_runtimes.sh runs `check_runtimes.py --check-args` before its 10-30 min build.
@pytest.mark.parametrize("out", ["a-file", "a-file/under/it"])
def test_check_runtimes_check_args_refuses_an_out_that_is_or_sits_under_a_file(out, tmp_path):
    (tmp_path / "a-file").write_text("x")
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "check_runtimes.py"), "--check-args", "--out",
                             str(tmp_path / out)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--out" in result.stderr and "is a file, not a folder" in result.stderr
    assert "Traceback" not in result.stderr
    assert (tmp_path / "a-file").read_text() == "x"


def test_check_runtimes_check_args_takes_an_out_that_does_not_exist_yet(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "check_runtimes.py"), "--check-args", "--out",
                             str(tmp_path / "new" / "folder")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "new").exists()


# 2. gpu_long_context.sh names examples/ and tests/ by relative path.
def test_gpu_long_context_runs_its_steps_from_the_repository_when_called_from_elsewhere(tmp_path):
    log = tmp_path / "log"
    python = _recorder(tmp_path / "python", log)
    (tmp_path / "books").mkdir()
    result = _bash(REPO / "scripts" / "gpu_long_context.sh", "out", "books", "perplexity_64k", "cuda_tests",
                   cwd=tmp_path, PYTHON=str(python))
    assert result.returncode == 0, result.stdout + result.stderr
    calls = [line.split("|", 1) for line in log.read_text().splitlines() if "|" in line]
    assert [folder for folder, _ in calls] == [str(REPO), str(REPO)]
    first, second = (arguments.split() for _, arguments in calls)
    assert (REPO / first[0]).is_file() and (REPO / second[-1]).is_file()  # the example, the test file
    # OUTPUT_DIR and BOOKS_DIR stay relative to the calling folder
    assert first[first.index("--text-files") + 1] == str(tmp_path / "books" / "pg84.txt")
    assert first[first.index("--output-dir") + 1] == str(tmp_path / "out" / "perplexity_64k")
    assert (tmp_path / "out" / "perplexity_64k.log").is_file()


# 10. scripts/setup.sh installs into .venv; a bare `python3` has no torch after it.
@pytest.mark.parametrize("script", ["gpu_attention_speed.sh", "gpu_long_context.sh"])
def test_gpu_scripts_use_the_project_venv_unless_python_is_set(script, tmp_path):
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    (checkout / ".venv" / "bin").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / script, checkout / "scripts" / script)
    venv_log, other_log = tmp_path / "venv.log", tmp_path / "other.log"
    _recorder(checkout / ".venv" / "bin" / "python", venv_log, cuda_check_rc=1)
    arguments = ["out", str(tmp_path)] if script == "gpu_long_context.sh" else []
    result = _bash(checkout / "scripts" / script, *arguments, cwd=tmp_path)
    assert result.returncode == 1 and venv_log.read_text().startswith("-c ")  # stopped at the CUDA check
    other = _recorder(tmp_path / "other-python", other_log, cuda_check_rc=1)
    venv_log.unlink()
    _bash(checkout / "scripts" / script, *arguments, cwd=tmp_path, PYTHON=str(other))
    assert other_log.is_file() and not venv_log.exists()


# 5. compare_kernel_outputs.py: --against and --save are checked before the forwards (minutes at 64k).
def test_compare_kernel_outputs_refuses_hidden_states_of_another_shape_before_loading(tiny, monkeypatch, capsys):
    from safetensors.torch import save_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny / "model")
    saved_rows = 64 - config.max_position_embeddings  # --tokens 64 saved the positions beyond the native context
    save_file({"hidden": torch.zeros(saved_rows, config.hidden_size)}, tiny / "t64.safetensors")
    last = _refused_before_loading(script("compare_kernel_outputs"), [str(tiny / "model"), "--tokens", "128",
                                   "--against", str(tiny / "t64.safetensors")], monkeypatch, capsys)  # fmt: skip
    assert f"holds no hidden states of shape ({128 - config.max_position_embeddings}, {config.hidden_size})" in last
    assert f"(got ({saved_rows}, {config.hidden_size}))" in last


@pytest.mark.parametrize("option, value, message", [
    ("--against", "a-file", "is not a safetensors file"),
    ("--save", "no-folder/x.safetensors", "the folder {tiny}/no-folder does not exist; make it first"),
])  # fmt: skip
def test_compare_kernel_outputs_refuses_a_bad_file_before_loading(tiny, option, value, message, monkeypatch, capsys):
    last = _refused_before_loading(script("compare_kernel_outputs"), [str(tiny / "model"), "--tokens", "64", option,
                                   str(tiny / value)], monkeypatch, capsys)  # fmt: skip
    assert message.format(tiny=tiny) in last


# 6. check_vllm.py: bad values are refused, not masked by a missing vLLM venv or hit mid-run.
@pytest.mark.parametrize("option, value", [("--tokens", "-5"), ("--tokens", "0"), ("--threads", "0")])
def test_check_vllm_refuses_counts_below_one_before_anything_else(option, value, monkeypatch, capsys):
    module = script("check_vllm")
    monkeypatch.setattr(module, "preflight", lambda: pytest.fail("the arguments were not checked first"))
    with pytest.raises(SystemExit) as stopped:
        module.main([option, value])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"error: {option} must be at least 1, got {value}")


# 6b. An option given twice is refused (hf_rope_ext's ArgumentParser), not the last value silently taken.
def test_check_vllm_refuses_an_option_given_twice_before_anything_else(monkeypatch, capsys):
    module = script("check_vllm")
    monkeypatch.setattr(module, "preflight", lambda: pytest.fail("the arguments were not checked first"))
    with pytest.raises(SystemExit) as stopped:
        module.main(["--tokens", "4096", "--tokens", "8192"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].endswith("error: --tokens given twice; give it once")


def test_compare_kernel_outputs_refuses_an_option_given_twice_before_loading(tiny, monkeypatch, capsys):
    last = _refused_before_loading(script("compare_kernel_outputs"), [str(tiny / "model"), "--tokens", "64",
                                   "--tokens", "128"], monkeypatch, capsys)  # fmt: skip
    assert last == "compare_kernel_outputs.py: error: --tokens given twice; give it once"


@pytest.mark.parametrize("name", ["check_vllm", "compare_kernel_outputs", "time_remapped_attention"])
def test_scripts_run_with_an_hf_rope_ext_without_the_given_once_parser(name, monkeypatch):
    """check_vllm's --worker runs where hf_rope_ext is not installed, and the other two are run with
    another checkout on PYTHONPATH (gpu_attention_speed.sh OTHER, --save): argparse's parser then."""
    import argparse

    import hf_rope_ext.arguments

    monkeypatch.delattr(hf_rope_ext.arguments, "ArgumentParser")  # an hf_rope_ext from before it
    assert script(name).ArgumentParser is argparse.ArgumentParser


# 7. The GPU sweep and profile scripts start minutes of work; --help and a machine without CUDA stop first.
@pytest.mark.parametrize("name", ["gpu_kernel_blocks", "gpu_profile_attention", "time_cache_record"])
def test_timing_scripts_answer_help_and_refuse_unknown_options_without_work(name, monkeypatch, capsys):
    module = script(name)
    monkeypatch.setattr(torch, "randn", lambda *a, **k: pytest.fail("the script started its work"))
    monkeypatch.setattr(torch, "randint", lambda *a, **k: pytest.fail("the script started its work"))
    for argv, code in ((["--help"], 0), (["--bogus-flag"], 2)):
        monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv])
        with pytest.raises(SystemExit) as stopped:
            module.main()
        assert stopped.value.code == code
    out, err = capsys.readouterr()
    assert out.startswith(f"usage: {name}.py [-h]") and "unrecognized arguments: --bogus-flag" in err


@pytest.mark.parametrize("name", ["gpu_kernel_blocks", "gpu_profile_attention"])
def test_cuda_scripts_say_in_one_line_that_no_gpu_is_visible(name, monkeypatch, capsys):
    module = script(name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch, "randn", lambda *a, **k: pytest.fail("the script started its work"))
    monkeypatch.setattr(sys, "argv", [f"{name}.py"])
    with pytest.raises(SystemExit) as stopped:
        module.main()
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no CUDA GPU visible;") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("script", ["compare_configurations", "compare_retrieval"])
def test_comparisons_report_ctrl_c_in_one_line(script, monkeypatch, capsys):
    """Ctrl-C: one line that says the finished cases are kept (exit 130), not the traceback of
    wherever it landed."""
    module = load_repo_script("examples", script, f"{script}_ctrl_c")

    def interrupted(parser):
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "run", interrupted)
    with pytest.raises(SystemExit) as stopped:
        module.main()
    assert stopped.value.code == 130
    error = capsys.readouterr().err.strip()
    assert error.startswith("interrupted: the finished") and "results.jsonl" in error and "\n" not in error
