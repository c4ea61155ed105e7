"""The demo's table (``hf-rope-ext demo``): each cell from the stored records, checked against a
float64 pooling of the bucket perplexities written in results.jsonl; its flags.

Tiny random Llamas (see conftest); every test here failed before the fix it covers.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from conftest import save_tiny_llama

from hf_rope_ext.cli import main as cli_main
from hf_rope_ext.evaluation import EvaluationError
from hf_rope_ext.evaluation.demo import check_one_document, demo_plan, demo_settings, demo_table
from hf_rope_ext.evaluation.records import recorded_steps

METHOD = "yarn"


def _reference_ppl(buckets, start, end):
    """exp of the token-weighted mean log perplexity of the buckets inside [start, end), in float64
    (a bucket [a, b) scores b - max(a, 1) tokens: position 0 is never predicted)."""
    pairs = [(math.log(ppl), b - max(a, 1)) for a, b, ppl in buckets if a >= start and b <= end]
    return math.exp(sum(log * count for log, count in pairs) / sum(count for _, count in pairs))


def _cells(table):
    """``{row label: [unpatched, patched]}`` of a printed demo table."""
    rows = {}
    for line in table.splitlines():
        parts = [part.strip() for part in line.strip().strip("|").split("|")]
        if parts[0].startswith(("perplexity", "passkey")):
            rows[parts[0]] = parts[1:]
    return rows


def _ranges(rows):
    return [tuple(map(int, re.match(r"perplexity of tokens (\d+)-(\d+)", label).groups()))
            for label in rows if label.startswith("perplexity")]  # fmt: skip


# -- records as the runner stores them, built by hand ------------------------------------------------


def _bucket_edges(native, length):
    size = native // 4
    return sorted({*range(0, length, size), native, length})


def _records(native, settings, ppl_of, correct_of):
    """A buckets-mode record of one document and one passkey record per depth, for both states;
    ``ppl_of(state, start)`` gives a bucket's perplexity, ``correct_of(state, depth)`` its count."""
    patched = (METHOD, settings.scale, recorded_steps(METHOD, demo_plan(settings).steps_per_doubling))
    common = {"model": "tiny", "dtype": "fp32", "native_context": native, "model_fingerprint": "f"}
    records = []
    for state in (("none", None, None), patched):
        method, scale, steps = state
        edges = _bucket_edges(native, settings.ppl_length)
        buckets = [[a, b, ppl_of(state, a)] for a, b in zip(edges, edges[1:])]
        tokens = sum(b - max(a, 1) for a, b, _ in buckets)
        nll = sum(math.log(ppl) * (b - max(a, 1)) for a, b, ppl in buckets) / tokens
        records.append({"kind": "perplexity", "mode": "buckets", "method": method, "scale": scale,
                        "steps_per_doubling": steps, **common, "document": "book", "document_sha256": "d",
                        "context_length": settings.ppl_length, "stride": None, "eval_tokens": None,
                        "bucket_size": native // 4, "buckets": buckets, "nll": nll, "ppl": math.exp(nll),
                        "tokens": tokens})  # fmt: skip
        for depth in settings.depths:
            records.append({"kind": "retrieval", "task": "passkey", "method": method, "scale": scale,
                            "steps_per_doubling": steps, **common, "length": settings.passkey_lengths[0],
                            "depth": depth, "trials": settings.trials, "seed": 0, "needle_count": None,
                            "max_new_tokens": 8, "correct": correct_of(state, depth)})  # fmt: skip
    return records


def test_demo_table_counts_a_case_stored_twice_once():
    native = 256
    settings = demo_settings(native, False, method=METHOD)  # depths 0.25, 0.75; one trial each
    records = _records(native, settings, lambda state, start: 10.0 + start / 7 + (state[0] == "none"),
                       lambda state, depth: int(state[0] != "none" and depth < 0.5))  # fmt: skip
    once = _cells(demo_table(records, settings, native))
    twice = _cells(demo_table(records + [dict(record) for record in records], settings, native))
    assert twice == once
    passkey = f"passkey retrieved at {1.5 * native:.0f} tokens (depths 0.25, 0.75)"
    assert once[passkey] == ["0/2", "1/2"]  # two depths, one prompt each
    # A rerun whose duplicate holds another value keeps the first, as results.md does: not pooled.
    edited = [dict(record, buckets=[[a, b, 1e4] for a, b, _ in record["buckets"]]) if record["kind"] == "perplexity"
              else dict(record) for record in records]  # fmt: skip
    assert _cells(demo_table(records + edited, settings, native)) == once
    for label, (unpatched, _) in once.items():
        if label.startswith("perplexity"):
            (start, end), = _ranges([label])
            assert float(unpatched) == pytest.approx(_reference_ppl(records[0]["buckets"], start, end), abs=0.006)


@pytest.mark.parametrize("native", [258, 130, 257, 256])
def test_demo_rows_hold_the_positions_they_name(native):
    """With a native context that is not a multiple of 4, L0/2 and L0 + L0/4 fall inside a bucket:
    the rows follow the bucket edges, name exactly the positions they pool, and drop none."""
    settings = demo_settings(native, False, method=METHOD)
    length = settings.ppl_length
    records = _records(native, settings, lambda state, start: 20.0 + (start * 37 % 11), lambda state, depth: 0)
    rows = _cells(demo_table(records, settings, native))
    ranges = _ranges(rows)
    edges = _bucket_edges(native, length)
    # contiguous from about L0/2 to the end, split at L0, every edge a bucket edge
    assert all(a < b for a, b in ranges) and all(b == c for (_, b), (c, _) in zip(ranges, ranges[1:]))
    assert ranges[-1][1] == length and native in [a for a, _ in ranges]
    assert abs(ranges[0][0] - native / 2) <= native // 8 and {x for r in ranges for x in r} <= set(edges)
    for (start, end), cells in zip(ranges, [v for k, v in rows.items() if k.startswith("perplexity")]):
        for record, cell in zip([record for record in records if record["kind"] == "perplexity"], cells):
            assert float(cell) == pytest.approx(_reference_ppl(record["buckets"], start, end), abs=0.006)
    if native == 256:  # a multiple of 4: the rows are L0/2-L0, then steps of L0/4
        assert ranges == [(128, 256), (256, 320), (320, 384)]


def test_demo_table_shows_nan_and_inf_as_results_md_does():
    native = 256
    settings = demo_settings(native, False, method=METHOD)

    def ppl_of(state, start):  # the patched model overflows (fp16) beyond 320, and is NaN at 256-320
        if state[0] == "none" or start < native:
            return 30.0
        return math.nan if start < 320 else math.inf

    records = _records(native, settings, ppl_of, lambda state, depth: 0)
    rows = _cells(demo_table(records, settings, native))
    assert rows["perplexity of tokens 256-320 (one forward of 384)"] == ["30.00", "nan"]
    assert rows["perplexity of tokens 320-384 (one forward of 384)"] == ["30.00", "inf"]
    assert rows["perplexity of tokens 128-256 (one forward of 384)"] == ["30.00", "30.00"]
    # a state that was not run is an empty cell, not nan
    unpatched_only = [record for record in records if record["method"] == "none"]
    rows = _cells(demo_table(unpatched_only, settings, native))
    assert rows["perplexity of tokens 256-320 (one forward of 384)"] == ["30.00", ""]
    assert rows["passkey retrieved at 384 tokens (depths 0.25, 0.75)"] == ["0/2", ""]


# -- flags ---------------------------------------------------------------------------------------------


def test_demo_refuses_a_passkey_length_inside_the_native_context():
    with pytest.raises(EvaluationError, match=r"--passkey-length 32 is within the model's native context of 32 "
                                              r"tokens; .* Use more than 32 \(e.g. 48\)\.$"):  # fmt: skip
        demo_settings(32, False, passkey_length=32)
    assert demo_settings(32, False, passkey_length=33).passkey_lengths == (33,)
    assert demo_settings(32, True).passkey_lengths == (64, 128)  # the defaults lie beyond it


@pytest.mark.parametrize("text_files, dataset, count, given", [
    (["a.txt", "b.txt"], None, None, "2 (--text-files a.txt b.txt)"),
    ([], "pg19", 3, "3 (--dataset pg19 --num-documents 3)"),
    (["a.txt"], "pg19", None, "2 (--text-files a.txt, --dataset pg19)"),
])  # fmt: skip
def test_demo_refuses_more_than_one_document(text_files, dataset, count, given):
    with pytest.raises(EvaluationError, match=re.escape(f"The demo reads one document, got {given}; pass one")):
        check_one_document(text_files, dataset, count)
    check_one_document(["a.txt"], None, None)
    check_one_document([], "pg19", None)
    check_one_document([], "pg19", 1)


# -- the command, end to end ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint_130(tmp_path_factory):
    """A tiny random Llama with a native context of 130 tokens (not a multiple of 4) and the
    SmolLM2 tokenizer (the passkey prompts need a real one), with a text of about 4k tokens."""
    folder = tmp_path_factory.mktemp("tiny-130")
    save_tiny_llama(folder / "model", native_context=130)
    (folder / "book.txt").write_text(" ".join(f"Line {i} of a long and winding story." for i in range(400)))
    return folder


def _demo(folder, output, *extra):
    return cli_main(["demo", "--model", str(folder / "model"), "--device", "cpu", "--method", METHOD,
                     "--text-files", str(folder / "book.txt"), "--output-dir", str(output), "--no-progress", *extra])


def test_demo_command_table_from_the_stored_buckets_and_a_folder_written_twice(checkpoint_130, tmp_path, capsys):
    output = tmp_path / "demo"
    assert _demo(checkpoint_130, output) == 0
    first = _cells(capsys.readouterr().out)
    stored = [json.loads(line) for line in (output / "results.jsonl").read_text().splitlines()]
    ppl = {record["method"]: record["buckets"] for record in stored if record["kind"] == "perplexity"}
    edges = [0, 32, 64, 96, 128, 130, 160, 192, 195]  # by L0/4 = 32 tokens, split at L0
    assert sorted(ppl) == ["none", METHOD] and all([[a, b] for a, b, _ in ppl[method]] == [list(pair) for pair in
                                                   zip(edges, edges[1:])] for method in ppl)  # fmt: skip
    ranges = _ranges(first)
    assert ranges == [(64, 130), (130, 160), (160, 195)]  # bucket edges: never 65-130 or 162-194
    for (start, end), label in zip(ranges, first):
        for method, cell in zip(("none", METHOD), first[label]):
            assert float(cell) == pytest.approx(_reference_ppl(ppl[method], start, end), rel=1e-3)
    passkey = first["passkey retrieved at 195 tokens (depths 0.25, 0.75)"]
    assert all(re.fullmatch(r"[0-2]/2", cell) for cell in passkey)

    results = output / "results.jsonl"
    results.write_text(results.read_text() * 2)  # the same cases stored twice (two runs appending)
    assert _demo(checkpoint_130, output) == 0
    assert _cells(capsys.readouterr().out) == first


def test_demo_command_refuses_a_passkey_length_inside_the_native_context(checkpoint_130, tmp_path, capsys,
                                                                         monkeypatch):
    import hf_rope_ext.loading

    def not_loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(hf_rope_ext.loading, "load_model", not_loaded)
    assert _demo(checkpoint_130, tmp_path / "out", "--passkey-length", "130") == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        "error: --passkey-length 130 is within the model's native context of 130 tokens; the demo shows retrieval "
        "beyond it. Use more than 130 (e.g. 195)."
    ]


def test_demo_command_refuses_an_output_folder_it_cannot_write_before_the_model_loads(checkpoint_130, tmp_path,
                                                                                      capsys, monkeypatch):
    """A report name taken by a folder made the demo run every case, then fail on writing the
    reports, its table never printed: now one line, before the model loads."""
    import hf_rope_ext.loading

    def not_loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the output folder was checked")

    monkeypatch.setattr(hf_rope_ext.loading, "load_model", not_loaded)
    output = tmp_path / "out"
    (output / "results.md").mkdir(parents=True)
    assert _demo(checkpoint_130, output) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "results.md is a folder" in lines[0], lines
    assert not (output / "results.jsonl").exists()
