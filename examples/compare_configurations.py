"""Perplexity by position range for method configurations with their own parameters, one forward each.

`hf-rope-ext eval` takes method names; this script takes full configurations (method, scale and
the method's parameters), so parameter sweeps and the results table of the attention-level
methods come from one place. Each configuration is one forward over the first `--length`
tokens of the text; its loss is pooled over position ranges and appended to
`<output-dir>/results.jsonl` as soon as it is done (rerunning skips finished configurations).
The wall time of each forward is recorded, so speed ratios against `none` come from the same run.

    python examples/compare_configurations.py --model smollm2 --text-files ../shared/data/books/pg84.txt \\
        --length 16384 --scale 2 --output-dir outputs/attention_sweep \\
        --configs "none;yarn;self-extend:neighbor_window=2048;dual-chunk;self-extend+logn:neighbor_window=2048"

A configuration is `method[:key=value,...]`; values are parsed as JSON (numbers, true/false, null).
"""

from __future__ import annotations

import json
import logging
import resource
import sys
import time
from pathlib import Path

import torch

from hf_rope_ext import patch_model, unpatch_model
from hf_rope_ext.arguments import (
    add_attn_implementation_argument,
    add_dtype_argument,
    add_model_argument,
    add_option,
    add_output_dir_argument,
    add_text_files_argument,
    argument_parser,
    model_label,
)
from hf_rope_ext.auto import check_configurations, parse_configuration
from hf_rope_ext.cli import one_line
from hf_rope_ext.data import read_text, tokenize
from hf_rope_ext.evaluation.perplexity import bucket_perplexity
from hf_rope_ext.evaluation.documents import document_hash
from hf_rope_ext.evaluation.records import (
    append_record,
    check_output_dir,
    check_same_model,
    check_script_results,
    check_stored_fields,
    read_records,
    records_without_cut_line,
)
from hf_rope_ext.evaluation.runner import model_fingerprint
from hf_rope_ext.files import atomic_write_text
from hf_rope_ext.evaluation.cli import load_base_model
from hf_rope_ext.validation import check_scale, is_real

logger = logging.getLogger("compare_configurations")


# what results_tables reads from each record, and what it must hold
TABLE_FIELDS = {
    "config": ("configuration name", lambda value: isinstance(value, str)),
    "scale": ("number", is_real),
    "length": ("number of tokens", is_real),
    "edges": ("list of range edges", lambda value: isinstance(value, list) and all(is_real(e) for e in value)),
    "ppl": ("list of perplexities", lambda value: isinstance(value, list) and all(is_real(p) for p in value)),
    "seconds": ("number of seconds", is_real),
    "peak_gpu_gib": ("number of GiB", lambda value: value is None or is_real(value)),
    "peak_rss_gib": ("number of GiB", lambda value: value is None or is_real(value)),
}


def results_tables(rows: list[dict]) -> list[str]:
    """One markdown table per set of range edges (the columns differ), rows in file order."""
    base = {(r["length"], r.get("dtype", "fp32")): r["seconds"] for r in rows if r["config"] == "none"}
    by_edges: dict[tuple, list[dict]] = {}
    for r in rows:
        by_edges.setdefault(tuple(r["edges"]), []).append(r)
    lines = []
    for edges, group in by_edges.items():
        if lines:
            lines.append("")
        lines += ["| config | scale | length | dtype | " + " | ".join(f"ppl {a}-{b}" for a, b in zip(edges, edges[1:]))
                  + " | seconds | time vs none | peak memory GiB |",
                  "|---|---|---|---|" + "---|" * (len(edges) - 1) + "---|---|---|"]
        for r in group:
            none = base.get((r["length"], r.get("dtype", "fp32")))
            ratio = f"{r['seconds'] / none:.2f}" if none else ""
            memory = r.get("peak_gpu_gib", r.get("peak_rss_gib"))
            lines.append(f"| {r['config']} | {r['scale']:g} | {r['length']} | {r.get('dtype', 'fp32')} | "
                         + " | ".join(f"{p:.2f}" for p in r["ppl"])
                         + f" | {r['seconds']:.1f} | {ratio} | {'' if memory is None else f'{memory:.2f}'} |")
    return lines


def main() -> None:
    # Dash spellings; the underscore ones (--text_file, --output_dir) still parse.
    parser = argument_parser(__doc__.split("\n")[0])
    try:
        run(parser)
    except (ValueError, OSError, TypeError) as error:  # bad input (a missing model, a broken file): one line
        parser.error(one_line(error))
    except KeyboardInterrupt:  # Ctrl-C: one line, not the traceback of wherever it landed
        print("\ninterrupted: the finished configurations are kept in the --output-dir's results.jsonl; rerun the same "
              "command to go on.", file=sys.stderr)
        sys.exit(130)


def run(parser) -> None:
    add_model_argument(parser)
    add_text_files_argument(parser, required=True, help="one long document")
    add_option(parser, "--length", type=int, required=True, help="tokens per forward")
    add_option(parser, "--scale", type=float, required=True)
    add_option(parser, "--configs", required=True, help="';'-separated method[:key=value,...]; 'none' = unpatched")
    add_option(parser, "--ranges", default=None, help="comma-separated range edges (default 0,L0/2,L0,length)")
    add_output_dir_argument(parser, help="results.jsonl and table.md go here")
    add_attn_implementation_argument(parser, choices=("sdpa", "eager", "flash_attention_2"))
    add_dtype_argument(parser)
    args = parser.parse_args()
    if len(args.text_files) != 1:
        parser.error(f"give one document with --text-files, got {len(args.text_files)}")
    (args.text_file,) = args.text_files
    specs = [part.strip() for part in args.configs.split(";") if part.strip()]
    if not specs:
        parser.error(f"--configs names no configuration, got {args.configs!r}; give method[:key=value,...] or 'none'")
    try:
        # the syntax is checked before the model loads, the rest once it has
        parsed = [parse_configuration(spec) for spec in specs]
    except ValueError as error:
        parser.error(one_line(error))
    # the scale is written to every row and key, `none` rows too; 1 only for a run of `none` alone
    if not (args.scale == 1 and all(method == "none" for method, _ in parsed)):
        try:
            check_scale(args.scale, "--scale")
        except (ValueError, TypeError) as error:
            parser.error(one_line(error))
    same = [spec for index, spec in enumerate(specs) if parsed[index] in parsed[:index]]
    if same:  # the same forward twice, and two rows of one configuration
        parser.error(f"--configs lists {same[0]!r} twice (as the same method and parameters); list it once")
    if not args.text_file.is_file():
        parser.error(f"text file not found: {args.text_file}; pass an existing file with --text-files")
    if args.length < 2:
        parser.error(f"--length must be at least 2 tokens, got {args.length}")
    edges = None
    if args.ranges:
        try:
            edges = [int(x) for x in args.ranges.split(",")]
        except ValueError:
            parser.error(f"--ranges takes comma-separated whole numbers of tokens, got {args.ranges!r}")
        if edges[0] != 0 or edges[-1] != args.length or any(b <= a for a, b in zip(edges, edges[1:])):
            parser.error(f"--ranges must rise strictly from 0 to --length {args.length}, got {args.ranges!r}")
        if edges[1] < 2:  # position 0 is never scored (it has no context), so [0, 1) holds no token
            parser.error(f"--ranges: the first range [0, {edges[1]}) scores no token (position 0 is never "
                         f"predicted); start the second edge at 2 or more, got {args.ranges!r}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    output = Path(args.output_dir)
    check_output_dir(output, reports=False)  # its table is table.md, not eval's reports
    results_path = output / "results.jsonl"
    stored = records_without_cut_line(results_path)  # drops a line cut by an interrupted append from the file
    check_script_results(stored, results_path)  # an hf-rope-ext eval folder: refused before the model loads
    check_stored_fields(stored, results_path, TABLE_FIELDS)
    for record in stored:  # the table shows no text, and "time vs none" would compare two texts' forwards
        if record.get("text") != args.text_file.name:
            parser.error(f"{results_path} holds results for the text {record.get('text')!r}, not "
                         f"{args.text_file.name!r}; use another --output-dir for this text")
    done = {record.get("key"): record for record in stored}

    model, tokenizer = load_base_model(args.model, dtype=args.dtype, attn_implementation=args.attn_implementation)
    name, fingerprint = model_label(args.model), model_fingerprint(model)
    # a case's key names neither the model nor the text's content: refuse results of others
    check_same_model(stored, results_path, name, args.dtype, fingerprint)
    device = model.get_input_embeddings().weight.device
    native = int(model.config.max_position_embeddings)
    try:  # every configuration on this model before the first forward, not after the ones before it
        configurations = check_configurations(model, specs, args.scale, original_max_length=native)
    except ValueError as error:
        parser.error(one_line(error))
    ids = tokenize(tokenizer, read_text(args.text_file))
    if len(ids) < args.length:
        parser.error(f"{args.text_file} has {len(ids)} tokens, fewer than --length {args.length}")
    text_hash = document_hash(ids)
    for record in stored:
        if record.get("text") == args.text_file.name and record.get("document_sha256") != text_hash:
            parser.error(f"{results_path} holds results for a text named {args.text_file.name!r} with other content "
                         f"(token hash {record.get('document_sha256')} against {text_hash} now); rename the file, or "
                         "use another --output-dir")  # fmt: skip
    output.mkdir(parents=True, exist_ok=True)
    if edges is None:  # halves of the native context, then the rest; only the edges inside the input
        edges = [edge for edge in (0, native // 2, native) if edge < args.length] + [args.length]

    for spec, (method, params) in zip(specs, configurations):
        fields = {"config": spec, "scale": args.scale, "length": args.length, "text": Path(args.text_file).name,
                  "edges": edges}
        if args.dtype != "fp32":  # fp32 keys stay as they were, so earlier results are still found
            fields["dtype"] = args.dtype
        key = json.dumps(fields, sort_keys=True)
        if key in done:
            logger.info("%s: already done", spec)
            continue
        if method != "none":
            patch_model(model, args.scale, method, original_max_length=native, **params)
        try:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            with torch.no_grad():
                result = bucket_perplexity(model, [ids], args.length, boundaries=edges)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - start
        finally:
            if method != "none":
                unpatch_model(model)
        ppl = [ppl for _, _, ppl in result.bucket_ppls()]  # NaN for a range without scored tokens
        record = {"key": key, "config": spec, "scale": args.scale, "length": args.length, "edges": edges,
                  "ppl": ppl, "seconds": seconds,
                  # the process's peak resident memory so far (Linux: KiB), an upper bound for this forward
                  "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                  "dtype": args.dtype, "device": str(device), "model": name, "model_fingerprint": fingerprint,
                  "text": Path(args.text_file).name, "document_sha256": text_hash}
        if device.type == "cuda":  # this forward's own peak (the counter was reset before it)
            record["peak_gpu_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        append_record(results_path, record)
        done[key] = record
        logger.info("%s: %s (%.0f s)", spec, ", ".join(f"{p:.2f}" for p in ppl), seconds)

    lines = results_tables(read_records(results_path))
    atomic_write_text(output / "table.md", "\n".join(lines) + "\n")
    logger.info("\n%s", "\n".join(lines))


if __name__ == "__main__":
    main()
