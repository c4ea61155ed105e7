"""Run llama.cpp with the settings `hf-rope-ext runtimes` prints, and compare with transformers.

    scripts/check_runtimes.sh            # builds/reuses the runtime, runs everything, writes the table
    .venv/bin/python scripts/check_runtimes.py --phase all [--cases yarn-x4,linear-x2] [--tokens 12288]

For every case the same token ids (the first ``--tokens`` tokens of a book, BOS first, tokenized
once with the transformers tokenizer) go through

* ours: the patched transformers model on the dequantised SmolLM2 weights
  (``hf_rope_ext.loading.load_model("smollm2")`` + ``patch_model``, or ``load_patched`` of a
  ``save_patched`` checkpoint), losses from ``hf_rope_ext.evaluation.perplexity.token_losses``
  (what ``hf-rope-ext eval`` reports);
* theirs: llama.cpp through llama-cpp-python (scripts/llama_cpp_worker.py, run by the runtime's
  own python), with
  - path ``flags``: the base GGUF (SmolLM2's own Q4_1 file, or ``f32``: the dequantised
    checkpoint converted by llama.cpp's converter) and exactly the flags
    ``runtime_settings(...).llama_cpp.args`` gives;
  - path ``converted``: a ``save_patched`` checkpoint converted by llama.cpp's own
    convert_hf_to_gguf.py (``--outtype f32``), run with no RoPE flags.

Perplexity per bucket (0-4k, 4k-8k, 8k-12k) is computed from both loss arrays with the
bucket rule of ``bucket_perplexity``. Results go to outputs/runtimes/llama_cpp.{json,md};
per-case losses are cached under outputs/runtimes/work/, so a rerun skips finished cases.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hf_rope_ext.arguments import ArgumentParser  # noqa: E402
from hf_rope_ext.loading import cache_dir  # noqa: E402  (light import: no torch model yet)

BOOK = REPO.parent / "shared" / "data" / "books" / "pg84.txt"
LLAMA_CPP_VERSION = "0.3.36"
TOLERANCE = 0.01  # relative, per bucket; see README "Runtimes: checked by running them"


def runtime_root() -> Path:
    return cache_dir() / "runtimes"


def llama_python() -> Path:
    return runtime_root() / "llama-cpp" / "bin" / "python"


def vendor_dir() -> Path:
    return runtime_root() / "sdist" / f"llama_cpp_python-{LLAMA_CPP_VERSION}" / "vendor" / "llama.cpp"


def runtime_missing() -> str | None:
    """Why the llama.cpp runtime cannot run here, or None."""
    python = llama_python()
    if not python.is_file():
        return f"llama-cpp-python environment not found at {python.parent.parent} (build it with scripts/check_runtimes.sh)"
    probe = subprocess.run([str(python), "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                           capture_output=True, text=True)  # fmt: skip
    if probe.returncode != 0:
        return f"{python} cannot import llama_cpp: {probe.stderr.strip().splitlines()[-1:]}"
    if not (vendor_dir() / "convert_hf_to_gguf.py").is_file():
        return f"llama.cpp sources (convert_hf_to_gguf.py) not found under {vendor_dir()}"
    return None


# ----------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    path: str  # "flags" (base GGUF + printed flags) or "converted" (save_patched -> convert_hf_to_gguf.py)
    method: str  # "none" for the unpatched model
    scale: float = 1.0
    params: dict = field(default_factory=dict, hash=False, compare=False)
    weights: str = "q4_1"  # flags path: "q4_1" (SmolLM2's own GGUF) or "f32" (the dequantised checkpoint converted)
    n_batch: int = 512
    seq_div: str = "llama"  # grouped attention: "llama" (llama_memory_seq_div) or "add" (its sign fixed; see the worker)
    ours_key: str = ""  # ours results shared between cases with the same patch
    # What llama.cpp is compared with: "patch" (patch_model, the default) or "loop" (llama-cli's
    # grouped-attention loop redone in transformers: the reference for llama.cpp's own scheme,
    # with the key shift of seq_div recorded the way this case's llama.cpp run records it).
    reference: str = "patch"
    theirs_key: str = ""  # llama.cpp results shared between cases with the same run

    @property
    def ours(self) -> str:
        return self.ours_key or self.name

    @property
    def theirs(self) -> str:
        return self.theirs_key or self.name


def _flag_cases(weights: str) -> list[Case]:
    suffix = "" if weights == "q4_1" else "-f32"
    cases = [Case(f"none{suffix}", "flags", "none", weights=weights, ours_key="none")]
    for method in ("linear", "ntk", "yarn"):
        for scale in (2, 4):
            cases.append(Case(f"{method}-x{scale}{suffix}", "flags", method, scale, weights=weights,
                              ours_key=f"{method}-x{scale}"))  # fmt: skip
    for method in ("dynamic", "dynamic-yarn"):
        cases.append(Case(f"{method}-x2{suffix}", "flags", method, 2, weights=weights, ours_key=f"{method}-x2"))
    return cases


CASES: list[Case] = [
    *_flag_cases("q4_1"),
    # self-extend: our default (per-query group size) and the paper's fixed form with the very
    # group and window llama.cpp is given; llama-cli's default batch (2048) and 512.
    Case("self-extend-x2", "flags", "self-extend", 2, n_batch=2048),
    # (its printed flags are the default's, so it shares that llama.cpp run)
    Case("self-extend-x2-fixed", "flags", "self-extend", 2, {"group_size": 4, "neighbor_window": 4096},
         n_batch=2048, theirs_key="self-extend-x2"),  # fmt: skip
    Case("self-extend-x2-b512", "flags", "self-extend", 2, n_batch=512, ours_key="self-extend-x2"),
    # the same loop with llama.cpp's seq_div sign error corrected (positions divided by seq_add)
    Case("self-extend-x2-divfix", "flags", "self-extend", 2, n_batch=2048, seq_div="add", ours_key="self-extend-x2"),
    Case("self-extend-x2-fixed-divfix", "flags", "self-extend", 2, {"group_size": 4, "neighbor_window": 4096},
         n_batch=2048, seq_div="add", ours_key="self-extend-x2-fixed", theirs_key="self-extend-x2-divfix"),  # fmt: skip
    # the two llama.cpp runs above against llama-cli's loop redone in transformers (same flags,
    # batches and position moves; keys re-rotated with the shift llama.cpp records)
    Case("self-extend-x2-loop", "flags", "self-extend", 2, n_batch=2048, reference="loop", theirs_key="self-extend-x2"),
    Case("self-extend-x2-divfix-loop", "flags", "self-extend", 2, n_batch=2048, seq_div="add", reference="loop",
         theirs_key="self-extend-x2-divfix"),  # fmt: skip
    Case("converted-linear-x2", "converted", "linear", 2),
    Case("converted-ntk-x2", "converted", "ntk", 2),
    Case("converted-yarn-x4", "converted", "yarn", 4),
    *_flag_cases("f32"),
]
CASES_BY_NAME = {case.name: case for case in CASES}
# Most telling first (a run is resumable and reports after every case): exact settings on both
# weight files and the converted checkpoints, then the approximations, then the other scales.
FIRST = ["none", "yarn-x4", "linear-x2", "ntk-x2", "converted-yarn-x4", "converted-linear-x2", "converted-ntk-x2",
         "none-f32", "yarn-x4-f32", "linear-x2-f32", "ntk-x2-f32", "dynamic-x2", "dynamic-yarn-x2", "self-extend-x2",
         "self-extend-x2-divfix", "self-extend-x2-loop", "self-extend-x2-divfix-loop", "self-extend-x2-fixed",
         "self-extend-x2-fixed-divfix", "yarn-x2", "linear-x4", "ntk-x4"]  # fmt: skip
DEFAULT_CASES = FIRST + [case.name for case in CASES if case.name not in FIRST]


def base_settings(case: Case):
    """What `hf-rope-ext runtimes --method M --scale S --model-dir BASE` prints for this case."""
    from transformers import AutoConfig

    from hf_rope_ext.loading import smollm2_checkpoint
    from hf_rope_ext.runtimes import runtime_settings

    config = AutoConfig.from_pretrained(smollm2_checkpoint())
    return runtime_settings(config, case.method, case.scale, **case.params)


# ----------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------


class Workspace:
    def __init__(self, out: Path, tokens: int):
        self.out = out
        self.tokens = tokens
        self.work = out / "work" / f"t{tokens}"
        for sub in ("ours", "llama_cpp", "jobs"):
            (self.work / sub).mkdir(parents=True, exist_ok=True)
        self.ids_path = self.work / "ids.npy"

    def ours_path(self, case: Case) -> Path:
        # A converted case's reference is the same patch: load_patched of its checkpoint is checked
        # to give the very same losses (load_patched_check), so the long forward is not repeated.
        key = f"{case.method}-x{case.scale:g}" if case.path == "converted" else case.ours
        if case.reference == "loop":
            _, ga_n, ga_w = grouped_attention_flags(case)
            key = f"loop-n{ga_n}-w{ga_w}-b{case.n_batch}-{case.seq_div}"
        return self.work / "ours" / f"{key}.npy"

    def check_path(self, case: Case) -> Path:
        return self.work / "ours" / f"load_patched-{case.method}-x{case.scale:g}-check.json"

    def theirs_path(self, case: Case) -> Path:
        return self.work / "llama_cpp" / f"{case.theirs}.npy"

    def meta_path(self, case: Case) -> Path:
        return self.work / "llama_cpp" / f"{case.theirs}.json"


def checkpoint_dir(case: Case) -> Path:
    return runtime_root() / "checkpoints" / f"smollm2-{case.method}-x{case.scale:g}"


def gguf_path(case: Case) -> Path:
    if case.path == "converted":
        return runtime_root() / "gguf" / f"smollm2-{case.method}-x{case.scale:g}.f32.gguf"
    if case.weights == "f32":
        return runtime_root() / "gguf" / "smollm2-base.f32.gguf"
    from hf_rope_ext.loading import SMOLLM2_GGUF, smollm2_gguf_folder

    return smollm2_gguf_folder() / SMOLLM2_GGUF


# ----------------------------------------------------------------------------------------------
# Ours: the transformers side
# ----------------------------------------------------------------------------------------------


def token_ids(ws: Workspace) -> np.ndarray:
    if ws.ids_path.is_file():
        return np.load(ws.ids_path)
    from transformers import AutoTokenizer

    from hf_rope_ext.data import read_text, tokenize
    from hf_rope_ext.loading import smollm2_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint())
    ids = tokenize(tokenizer, read_text(BOOK))  # BOS first, as `hf-rope-ext eval --text-files` does
    if len(ids) < ws.tokens:
        raise SystemExit(f"{BOOK} has {len(ids)} tokens, fewer than {ws.tokens}")
    ids = ids[: ws.tokens].numpy().astype(np.int64)
    np.save(ws.ids_path, ids)
    return ids


def run_ours(ws: Workspace, cases: list[Case]) -> None:
    import torch

    from hf_rope_ext import patch_model, unpatch_model
    from hf_rope_ext.evaluation.perplexity import token_losses
    from hf_rope_ext.hub import load_patched, save_patched
    from hf_rope_ext.loading import load_model

    torch.set_num_threads(2)
    ids = torch.from_numpy(token_ids(ws))
    model = tokenizer = None
    for case in cases:
        target = ws.ours_path(case)
        if target.is_file():
            continue
        started = time.time()
        if model is None:
            model, tokenizer = load_model("smollm2", dtype="fp32", attn_implementation="sdpa", device="cpu")
        if case.reference == "loop":
            _, ga_n, ga_w = grouped_attention_flags(case)
            losses = grouped_loop_losses(model, ids, ga_n, ga_w, case.n_batch, case.seq_div)
        elif case.method == "none":
            losses = token_losses(model, ids)
        else:
            patch_model(model, case.scale, case.method, **case.params)
            try:
                losses = token_losses(model, ids)
            finally:
                unpatch_model(model)
        np.save(target, losses.double().numpy())
        print(f"[ours] {case.name}: {time.time() - started:.0f}s", flush=True)
    for case in cases:
        if case.path == "converted" and not ws.check_path(case).is_file():
            if model is None:
                model, tokenizer = load_model("smollm2", dtype="fp32", attn_implementation="sdpa", device="cpu")
            ws.check_path(case).write_text(json.dumps(load_patched_check(model, tokenizer, case, ids)))


def grouped_attention_flags(case: Case) -> tuple[list[str], int, int]:
    """(printed flags, --grp-attn-n, --grp-attn-w) of a grouped-attention case."""
    args, _, _ = case_args(case)
    values = dict(zip(args[0::2], args[1::2]))
    return args, int(values["--grp-attn-n"]), int(values["--grp-attn-w"])


def grouped_loop_losses(model, ids, ga_n: int, ga_w: int, n_batch: int, seq_div: str):
    """Per-token losses of llama-cli's grouped-attention loop (tools/completion/completion.cpp,
    the loop llama_cpp_worker.py runs) computed by the unpatched transformers model.

    The prompt goes in batches of ``n_batch`` tokens at positions ``n_past ..``; before each batch
    the positions of cached tokens move as llama_memory_seq_add / seq_div move them, and each
    cached key is re-rotated by the shift llama.cpp records for it (RoPE rotations compose, so
    rotating a key by ``d`` moves it from position p to p + d). ``seq_div="add"`` records the
    shift of a division as ``p_new - p_old``; ``"llama"`` as llama.cpp's ``pos_div`` does,
    ``p_old - p_new``. float64 angles, as in the patch's own re-rotation.
    """
    import inspect

    import torch
    from transformers import DynamicCache

    from hf_rope_ext.compat import cache_argument_name

    cache_keyword = cache_argument_name(inspect.signature(model.forward).parameters)
    inv_freq = model.model.rotary_emb.inv_freq.double()
    cache = DynamicCache(config=model.config)
    position = torch.empty(0, dtype=torch.long)  # each cached token's position (what the mask and n_past see)
    rotated_to = torch.empty(0, dtype=torch.long)  # the position its cached key is rotated to

    def add(p0: int, p1: int, delta: int) -> None:
        inside = (position >= p0) & (position < p1)
        position[inside] += delta
        rotated_to[inside] += delta

    def divide(p0: int, p1: int, d: int) -> None:
        inside = (position >= p0) & (position < p1)
        old = position[inside]
        new = torch.div(old, d, rounding_mode="floor")
        position[inside] = new
        rotated_to[inside] += (new - old) if seq_div == "add" else (old - new)

    # Written out here rather than taken from hf_rope_ext.attention: this loop is the reference the
    # llama.cpp runs are judged against, so it shares no code with the patch it is compared to.
    def rotate_keys(delta: torch.Tensor) -> None:
        if not bool(delta.any()):
            return
        angles = delta.double()[:, None] * inv_freq[None]
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        for layer in cache.layers:
            keys = layer.keys.double()
            half = keys.shape[-1] // 2
            rotated = torch.cat([-keys[..., half:], keys[..., :half]], -1)
            layer.keys = (keys * cos + rotated * sin).to(layer.keys.dtype)

    losses = []
    n_past = ga_i = 0
    with torch.no_grad():
        for start in range(0, len(ids), n_batch):
            chunk = ids[start : start + n_batch]
            before = rotated_to.clone()
            while n_past >= ga_i + ga_w:  # completion.cpp, "context extension via Self-Extend"
                ib = (ga_n * ga_i) // ga_w
                bd = (ga_w // ga_n) * (ga_n - 1)
                dd = (ga_w // ga_n) - ib * bd - ga_w
                add(ga_i, n_past, ib * bd)
                divide(ga_i + ib * bd, ga_i + ib * bd + ga_w, ga_n)
                add(ga_i + ib * bd + ga_w, n_past + ib * bd, dd)
                n_past -= bd
                ga_i += ga_w // ga_n
            rotate_keys(rotated_to - before)
            positions = torch.arange(n_past, n_past + len(chunk))
            logits = model(chunk[None], position_ids=positions[None], use_cache=True, **{cache_keyword: cache}).logits[0]
            targets = ids[start + 1 : start + 1 + len(chunk)]
            losses.append(torch.nn.functional.cross_entropy(logits[: len(targets)].double(), targets, reduction="none"))
            position = torch.cat([position, positions])
            rotated_to = torch.cat([rotated_to, positions])
            n_past += len(chunk)
    return torch.cat(losses)


CHECK_TOKENS = 2048


def load_patched_check(model, tokenizer, case: Case, ids) -> dict[str, Any]:
    """load_patched of the saved checkpoint against patch_model on the base model, first 2048 tokens."""
    import torch

    from hf_rope_ext import patch_model, unpatch_model
    from hf_rope_ext.evaluation.perplexity import token_losses
    from hf_rope_ext.hub import load_patched, save_patched

    folder = checkpoint_dir(case)
    if not (folder / "config.json").is_file():
        patch_model(model, case.scale, case.method, **case.params)
        save_patched(model, folder, tokenizer=tokenizer)
        unpatch_model(model)
    head = ids[:CHECK_TOKENS]
    reloaded = load_patched(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    from_checkpoint = token_losses(reloaded, head).double()
    del reloaded
    patch_model(model, case.scale, case.method, **case.params)
    try:
        patched = token_losses(model, head).double()
    finally:
        unpatch_model(model)
    return {"tokens": int(len(head)), "max_abs_loss_diff": float((from_checkpoint - patched).abs().max())}


def save_checkpoints(cases: list[Case]) -> None:
    """save_patched checkpoints of the converted cases (ours writes them too; this is for --phase convert)."""
    import torch

    from hf_rope_ext import patch_model, unpatch_model
    from hf_rope_ext.hub import save_patched
    from hf_rope_ext.loading import load_model

    model = tokenizer = None
    for case in cases:
        folder = checkpoint_dir(case)
        if case.path != "converted" or (folder / "config.json").is_file():
            continue
        if model is None:
            torch.set_num_threads(2)
            model, tokenizer = load_model("smollm2", dtype="fp32", device="cpu")
        patch_model(model, case.scale, case.method, **case.params)
        save_patched(model, folder, tokenizer=tokenizer)
        unpatch_model(model)


# ----------------------------------------------------------------------------------------------
# Converting with llama.cpp's own converter
# ----------------------------------------------------------------------------------------------


def convert(source: Path, target: Path) -> None:
    if target.is_file():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    # The converter's own gguf-py, and sentencepiece (its Llama vocabulary code imports it even for
    # BPE tokenizers), installed beside the runtime so the project's environment stays untouched.
    extra = [str(vendor_dir() / "gguf-py"), str(runtime_root() / "convert-extra")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(extra)}
    command = [sys.executable, str(vendor_dir() / "convert_hf_to_gguf.py"), str(source), "--outtype", "f32",
               "--outfile", str(partial)]  # fmt: skip
    log = target.with_suffix(".log")
    with open(log, "w") as handle:
        result = subprocess.run(command, env=env, stdout=handle, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        raise SystemExit(f"convert_hf_to_gguf.py failed for {source}; see {log}")
    partial.rename(target)


def convert_all(cases: list[Case]) -> None:
    from hf_rope_ext.loading import smollm2_checkpoint

    save_checkpoints(cases)
    for case in cases:
        if case.path == "converted":
            convert(checkpoint_dir(case), gguf_path(case))
        elif case.weights == "f32":
            convert(smollm2_checkpoint(), gguf_path(case))


def rope_keys(path: Path) -> dict[str, Any]:
    """The GGUF keys a file holds about RoPE and context (read with gguf-py's GGUFReader)."""
    sys.path.insert(0, str(vendor_dir() / "gguf-py"))
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    keys = {}
    for name, value in reader.fields.items():
        if ".rope." in name or name.endswith(".context_length") or name == "general.architecture":
            contents = value.contents()
            keys[name] = contents.name if hasattr(contents, "name") else contents
    return keys


# ----------------------------------------------------------------------------------------------
# Theirs: llama.cpp
# ----------------------------------------------------------------------------------------------


def case_args(case: Case) -> tuple[list[str], int | None, str]:
    """(llama-cli flags, n_ctx override, status) for a case: the printed flags, nothing hand-typed."""
    if case.path == "converted":
        return [], 0, "exact"  # no flags at all: n_ctx 0 = the file's own context_length
    if case.method == "none":
        return ["--ctx-size", str(16384)], None, "exact"
    command = base_settings(case).llama_cpp
    return list(command.args), None, command.status


def run_theirs(ws: Workspace, cases: list[Case]) -> None:
    missing = runtime_missing()
    if missing:
        raise SystemExit(missing)
    token_ids(ws)
    for case in cases:
        if ws.theirs_path(case).is_file():
            continue
        if case.theirs != case.name:
            raise SystemExit(f"{case.name} compares the llama.cpp run {case.theirs}: run that case first")
        model = gguf_path(case)
        if not model.is_file():
            convert_all([case])
        args, n_ctx, _ = case_args(case)
        job = {
            "model": str(model),
            "args": args,
            "n_ctx": n_ctx,
            "ids": str(ws.ids_path),
            "out": str(ws.theirs_path(case)),
            "meta": str(ws.meta_path(case)),
            "n_batch": case.n_batch,
            "seq_div": case.seq_div,
            "n_ubatch": 512,
            "threads": 2,
            "kv_type": "f32",
        }
        started = time.time()
        run_worker(job, ws.work / "jobs" / f"{case.name}.json", ws.work / "llama_cpp" / f"{case.name}.log")
        print(f"[llama.cpp] {case.name}: {time.time() - started:.0f}s", flush=True)


def run_worker(job: dict[str, Any], job_path: Path, log: Path) -> None:
    """Run scripts/llama_cpp_worker.py on one job (see its docstring) with the runtime's python."""
    job_path.write_text(json.dumps(job, indent=1))
    with open(log, "w") as handle:
        result = subprocess.run([str(llama_python()), str(REPO / "scripts" / "llama_cpp_worker.py"), str(job_path)],
                                stdout=handle, stderr=subprocess.STDOUT)  # fmt: skip
    if result.returncode != 0:
        tail = log.read_text().strip().splitlines()[-3:]
        raise SystemExit(f"llama.cpp worker failed for {job_path.stem}: {tail} (log: {log})")


# ----------------------------------------------------------------------------------------------
# Comparison
# ----------------------------------------------------------------------------------------------


def compare(ours: np.ndarray, theirs: np.ndarray, bucket_size: int = 4096) -> dict[str, Any]:
    n = len(ours) + 1
    boundaries = list(range(0, n, bucket_size)) + ([n] if n % bucket_size else [n])
    boundaries = sorted(set(boundaries))
    from hf_rope_ext.evaluation.perplexity import buckets_of_losses

    a, b = buckets_of_losses(ours, boundaries), buckets_of_losses(theirs, boundaries)
    rows = []
    for (start, end, ppl_a), (_, _, ppl_b) in zip(a.bucket_ppls(), b.bucket_ppls()):
        part = slice(max(start, 1) - 1, end - 1)
        rows.append({
            "bucket": [start, end],
            "ours": ppl_a,
            "llama_cpp": ppl_b,
            "rel_diff": ppl_b / ppl_a - 1,
            "mean_abs_token_diff": float(np.abs(ours[part] - theirs[part]).mean()),
        })  # fmt: skip
    return {
        "buckets": rows,
        "overall": {"ours": a.ppl, "llama_cpp": b.ppl, "rel_diff": b.ppl / a.ppl - 1},
        "max_abs_token_diff": float(np.abs(ours - theirs).max()),
        "token_loss_corr": float(np.corrcoef(ours, theirs)[0, 1]),
    }


def report(ws: Workspace, cases: list[Case], bucket_size: int = 4096) -> list[dict[str, Any]]:
    results = []
    for case in cases:
        if not (ws.ours_path(case).is_file() and ws.theirs_path(case).is_file()):
            continue
        ours, theirs = np.load(ws.ours_path(case)), np.load(ws.theirs_path(case))
        meta = json.loads(ws.meta_path(case).read_text())
        args, _, status = case_args(case)
        entry = {
            "case": case.name,
            "path": case.path,
            "weights": "f32" if case.path == "converted" else case.weights,
            "method": case.method,
            "scale": case.scale,
            "params": case.params,
            "status": status,
            "reference": case.reference,
            "llama_cpp_run": case.theirs,
            "llama_cpp_args": args,
            "n_batch": case.n_batch,
            "seq_div": case.seq_div,
            "n_ctx": meta["n_ctx"],
            "ours_source": "patch_model(load_model('smollm2'))",
            "llama_cpp_seconds": meta["seconds"],
            **compare(ours, theirs, bucket_size),
        }
        if case.path == "converted":
            if ws.check_path(case).is_file():
                entry["load_patched_check"] = json.loads(ws.check_path(case).read_text())
            entry["gguf_rope_keys"] = {key: value for key, value in meta["gguf_metadata"].items()
                                       if ".rope." in key or key.endswith("context_length")}  # fmt: skip
        if status == "exact":
            entry["within_tolerance"] = all(abs(row["rel_diff"]) <= TOLERANCE for row in entry["buckets"])
        results.append(entry)
    unsupported = []
    from hf_rope_ext.runtimes import runtime_settings  # noqa: F401  (the longrope row below)

    longrope = Case("longrope-x2", "flags", "longrope", 2, {"long_factor": [2.0] * 32, "short_factor": [1.0] * 32})
    command = base_settings(longrope).llama_cpp
    unsupported.append({"method": "longrope", "scale": 2, "status": command.status, "notes": list(command.notes)})
    stem = "llama_cpp" if ws.tokens == 12288 else f"llama_cpp_t{ws.tokens}"  # shorter checks never replace the table
    (ws.out / f"{stem}.json").write_text(json.dumps(
        {"tokens": ws.tokens, "bucket_size": bucket_size, "book": BOOK.name, "tolerance": TOLERANCE, "llama_cpp_python": LLAMA_CPP_VERSION,
         "results": results, "not_run": unsupported}, indent=1))  # fmt: skip
    (ws.out / f"{stem}.md").write_text(markdown(results, unsupported, ws.tokens))
    return results


def markdown(results: list[dict[str, Any]], unsupported: list[dict[str, Any]], tokens: int) -> str:
    lines = [
        f"Perplexity per bucket, first {tokens} tokens of {BOOK.name}: ours (transformers, patched) against "
        f"llama.cpp (llama-cpp-python {LLAMA_CPP_VERSION}); diff = llama.cpp / ours - 1; "
        f"|dl| = mean absolute difference of per-token losses.",
        "",
        "| path | weights | method | scale | llama.cpp flags | status | bucket | ours | llama.cpp | diff | abs dl |",
        "|---|---|---|---|---|---|---|---:|---:|---:|---:|",
    ]
    for entry in results:
        flags = " ".join(a for a in entry["llama_cpp_args"]) or "(none)"
        if entry["method"] == "self-extend":
            flags += f" (batch {entry['n_batch']}" + (", seq_div sign fixed)" if entry.get("seq_div") == "add" else ")")
        label = entry["method"] + (" fixed G" if entry["params"].get("group_size") else "")
        if entry.get("reference") == "loop":
            label = "llama-cli's loop in transformers"
        for index, row in enumerate(entry["buckets"]):
            start, end = row["bucket"]
            first = index == 0
            lines.append(
                f"| {entry['path'] if first else ''} | {entry['weights'] if first else ''} | {label if first else ''} "
                f"| {entry['scale']:g} | {('`' + flags + '`') if first else ''} | {entry['status'] if first else ''} "
                f"| {start // 1024}k-{-(-end // 1024)}k | {row['ours']:.3f} | {row['llama_cpp']:.3f} "
                f"| {row['rel_diff'] * 100:+.2f}% | {row['mean_abs_token_diff']:.4f} |"
            )
    for entry in unsupported:
        lines.append(f"| - | - | {entry['method']} | {entry['scale']:g} | - | {entry['status']} | not run | | | | |")
    keys = [entry for entry in results if entry["path"] == "converted"]
    if keys:
        lines += ["", "GGUF RoPE keys written by convert_hf_to_gguf.py:", ""]
        for entry in keys:
            written = ", ".join(f"{key}={value}" for key, value in sorted(entry["gguf_rope_keys"].items()))
            lines.append(f"- {entry['method']} x{entry['scale']:g}: {written}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase", choices=("ours", "convert", "llama", "report", "all"), default="all")
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES), help="comma-separated case names")
    parser.add_argument("--tokens", type=int, default=12288)
    parser.add_argument("--bucket-size", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "runtimes")
    parser.add_argument("--check-args", action="store_true",
                        help="only check the arguments and exit (check_runtimes.sh does, before its long set-up)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.cases.split(",") if name not in CASES_BY_NAME]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; known: {', '.join(CASES_BY_NAME)}")
    for option, value in (("--tokens", args.tokens), ("--bucket-size", args.bucket_size)):
        if value < 1:
            parser.error(f"{option} must be at least 1, got {value}")
    # The first part of --out that exists must be a folder, or the workspace cannot be made (after the build).
    existing = next(path for path in (args.out, *args.out.parents) if path.exists())
    if not existing.is_dir():
        parser.error(f"--out {args.out}: {existing} is a file, not a folder; give a folder for the results")
    if args.check_args:
        return
    cases = [CASES_BY_NAME[name] for name in args.cases.split(",")]
    ws = Workspace(args.out, args.tokens)
    token_ids(ws)
    if args.phase == "all":
        if runtime_missing():
            raise SystemExit(runtime_missing())
        for case in cases:  # case by case, so that an interrupted run has reported what it finished
            convert_all([case])
            run_ours(ws, [case])
            run_theirs(ws, [case])
            report(ws, cases, args.bucket_size)
    if args.phase == "convert":
        convert_all(cases)
    if args.phase == "ours":
        run_ours(ws, cases)
    if args.phase == "llama":
        run_theirs(ws, cases)
    if args.phase in ("report", "all"):
        results = report(ws, cases, args.bucket_size)
        print((ws.out / ("llama_cpp.md" if ws.tokens == 12288 else f"llama_cpp_t{ws.tokens}.md")).read_text())
        failed = [entry["case"] for entry in results if entry.get("within_tolerance") is False]
        if failed:
            print(f"outside the {TOLERANCE:.0%} tolerance: {', '.join(failed)}")
            raise SystemExit(1)


if __name__ == "__main__":
    main()
