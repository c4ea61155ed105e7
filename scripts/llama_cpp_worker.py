"""llama.cpp side of scripts/check_runtimes.py: per-token losses of one token sequence.

Run by the python of the llama-cpp-python environment (not the project's), with one job file:

    python llama_cpp_worker.py JOB.json

JOB.json holds ``model`` (a GGUF file), ``args`` (llama-cli flags exactly as
``hf-rope-ext runtimes`` prints them, e.g. ["--rope-scaling", "yarn", "--rope-scale", "4", ...]),
``ids`` (a .npy of int64 token ids, BOS first), ``out`` (.npy written: float64 losses
``-log p(x_t | x_<t)`` for t = 1 .. n-1), ``meta`` (.json written), and optional ``n_batch``,
``n_ubatch``, ``threads``, ``kv_type`` ("f32" or "f16"), ``flash_attn``, ``seq_div``.

The flags are read as llama.cpp's common/arg.cpp reads them, and every setting not given keeps
llama-cli's default ("not set": the GGUF's own value), so a file run "with no flags" reads its
RoPE from its metadata only. llama-cpp-python's own ``Llama`` defaults differ from llama-cli's
(it passes yarn_beta_fast=32, yarn_beta_slow=1, yarn_attn_factor=1, which override the GGUF),
so the CLI's values are passed explicitly.

``--grp-attn-n/--grp-attn-w`` reproduce llama-cli's grouped attention (Self-Extend) loop from
the vendored tools/completion/completion.cpp: the prompt is decoded in batches of ``n_batch``
tokens, and before each batch the cached positions are shifted and divided block by block with
llama_memory_seq_add / llama_memory_seq_div.

``seq_div``: "llama" (default) calls llama_memory_seq_div as llama-cli does. "add" divides the
positions with one llama_memory_seq_add per position instead. The two should agree, but
llama.cpp's ``llama_kv_cells::pos_div`` records the key shift with the wrong sign
(``shift += p_old - p_new``; ``pos_add`` records ``p_new - p_old``), so after llama_memory_seq_div
the cached keys are rotated away from their new positions instead of onto them. "add" is what
llama-cli's loop computes once that sign is fixed.

No pickle: numpy arrays and JSON only. Needs only numpy and llama_cpp.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time

import numpy as np

import llama_cpp

# llama-cli's defaults for what a flag can set (common/common.h): negative / zero = "from the model".
CLI_DEFAULTS = {
    "rope_scaling_type": llama_cpp.LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED,
    "rope_freq_base": 0.0,
    "rope_freq_scale": 0.0,
    "yarn_ext_factor": -1.0,
    "yarn_attn_factor": -1.0,
    "yarn_beta_fast": -1.0,
    "yarn_beta_slow": -1.0,
    "yarn_orig_ctx": 0,
}
SCALING_TYPES = {
    "none": llama_cpp.LLAMA_ROPE_SCALING_TYPE_NONE,
    "linear": llama_cpp.LLAMA_ROPE_SCALING_TYPE_LINEAR,
    "yarn": llama_cpp.LLAMA_ROPE_SCALING_TYPE_YARN,
}
KV_TYPES = {"f32": llama_cpp.GGML_TYPE_F32, "f16": llama_cpp.GGML_TYPE_F16}


# Flags that set one llama_context parameter as they are (common/arg.cpp).
PARAM_FLAGS = {
    "--rope-freq-base": ("rope_freq_base", float),
    "--rope-freq-scale": ("rope_freq_scale", float),
    "--yarn-orig-ctx": ("yarn_orig_ctx", int),
    "--yarn-ext-factor": ("yarn_ext_factor", float),
    "--yarn-attn-factor": ("yarn_attn_factor", float),
    "--yarn-beta-fast": ("yarn_beta_fast", float),
    "--yarn-beta-slow": ("yarn_beta_slow", float),
}


def parse_flags(args: list[str]) -> tuple[dict, int, int, int]:
    """``(context params, n_ctx, grp_attn_n, grp_attn_w)`` from llama-cli flags, as common/arg.cpp sets them."""
    if len(args) % 2:
        raise SystemExit(f"flags must come in FLAG VALUE pairs, got {args}")
    params = dict(CLI_DEFAULTS)
    n_ctx, ga_n, ga_w = 4096, 1, 512  # llama-cli defaults: --ctx-size 4096, --grp-attn-n 1, --grp-attn-w 512
    for flag, value in zip(args[0::2], args[1::2]):
        if flag == "--rope-scaling":
            params["rope_scaling_type"] = SCALING_TYPES[value]
        elif flag == "--rope-scale":
            params["rope_freq_scale"] = 1.0 / float(value)
        elif flag in PARAM_FLAGS:
            name, kind = PARAM_FLAGS[flag]
            params[name] = kind(value)
        elif flag in ("--ctx-size", "-c"):
            n_ctx = int(value)
        elif flag in ("--grp-attn-n", "-gan"):
            ga_n = int(value)
        elif flag in ("--grp-attn-w", "-gaw"):
            ga_w = int(value)
        else:
            raise SystemExit(f"unknown llama-cli flag {flag!r}: teach llama_cpp_worker.py how common/arg.cpp reads it")
    return params, n_ctx, ga_n, ga_w


def seq_div(mem, p0: int, p1: int, d: int, mode: str) -> None:
    """Positions in ``[p0, p1)`` of sequence 0 become ``p // d`` (see ``seq_div`` in the docstring)."""
    if mode == "llama":
        llama_cpp.llama_memory_seq_div(mem, 0, p0, p1, d)
        return
    # Ascending order: a cell moves down to p // d <= p, below every range still to come.
    for p in range(p0, p1):
        if p // d != p:
            llama_cpp.llama_memory_seq_add(mem, 0, p, p + 1, p // d - p)


def gguf_metadata(model) -> dict[str, str]:
    """All string-valued metadata of the loaded model (llama_model_meta_*)."""
    out = {}
    buffer = ctypes.create_string_buffer(4096)
    for index in range(llama_cpp.llama_model_meta_count(model)):
        llama_cpp.llama_model_meta_key_by_index(model, index, buffer, len(buffer))
        key = buffer.value.decode("utf-8", "replace")
        if key.startswith("tokenizer.ggml."):
            continue  # the vocabulary: large and not needed
        llama_cpp.llama_model_meta_val_str_by_index(model, index, buffer, len(buffer))
        out[key] = buffer.value.decode("utf-8", "replace")
    return out


def row_losses(logits: np.ndarray, targets: np.ndarray, rows: int = 256) -> np.ndarray:
    """``logsumexp(logits[i]) - logits[i, targets[i]]`` in float64, ``rows`` rows at a time."""
    out = np.empty(len(targets), dtype=np.float64)
    for start in range(0, len(targets), rows):
        block = logits[start : start + rows].astype(np.float64)
        peak = block.max(axis=1)
        lse = peak + np.log(np.exp(block - peak[:, None]).sum(axis=1))
        out[start : start + rows] = lse - block[np.arange(len(block)), targets[start : start + rows]]
    return out


def main(job_path: str) -> None:
    job = json.loads(open(job_path).read())
    ids = np.load(job["ids"]).astype(np.int64)
    n = len(ids)
    params, n_ctx, ga_n, ga_w = parse_flags(list(job["args"]))
    if job.get("n_ctx") is not None:  # the converted files run "with no flags": n_ctx 0 = the GGUF's context_length
        n_ctx = int(job["n_ctx"])
    n_batch = int(job.get("n_batch", 512))
    n_ubatch = min(int(job.get("n_ubatch", 512)), n_batch)
    threads = int(job.get("threads", 2))
    kv = KV_TYPES[job.get("kv_type", "f32")]
    seq_div_mode = job.get("seq_div", "llama")
    if seq_div_mode not in ("llama", "add"):
        raise SystemExit(f"seq_div must be 'llama' or 'add', got {seq_div_mode!r}")

    llm = llama_cpp.Llama(
        model_path=job["model"],
        n_ctx=n_ctx,
        n_batch=n_batch,
        n_ubatch=n_ubatch,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=False,  # outputs are requested per token in our own batch below
        flash_attn=bool(job.get("flash_attn", False)),
        type_k=kv,
        type_v=kv,
        verbose=True,  # llama.cpp's log (freq_base, freq_scale, n_ctx, ...) goes to stderr
        **params,
    )
    ctx, model = llm._ctx.ctx, llm._model.model
    vocab = llm.n_vocab()
    n_ctx_real = llama_cpp.llama_n_ctx(ctx)
    n_ctx_seq = llama_cpp.llama_n_ctx_seq(ctx)
    # llama-cli stops (or shifts the context, dropping tokens) once n_past + batch >= n_ctx.
    if ga_n == 1 and n > min(n_ctx_real, n_ctx_seq) - 1:
        raise SystemExit(f"context too small: {n} tokens, n_ctx {n_ctx_real}, n_ctx_seq {n_ctx_seq}")
    if ga_n != 1:
        if ga_n <= 0 or ga_w % ga_n:
            raise SystemExit("grp_attn_w must be a multiple of grp_attn_n (completion.cpp asserts it)")
    mem = llama_cpp.llama_get_memory(ctx)
    batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
    losses = np.empty(n - 1, dtype=np.float64)
    positions_seen = []
    started = time.time()
    n_past, ga_i = 0, 0
    try:
        for start in range(0, n, n_batch):
            chunk = ids[start : start + n_batch]
            if ga_n != 1:
                # tools/completion/completion.cpp, "context extension via Self-Extend", verbatim.
                while n_past >= ga_i + ga_w:
                    ib = (ga_n * ga_i) // ga_w
                    bd = (ga_w // ga_n) * (ga_n - 1)
                    dd = (ga_w // ga_n) - ib * bd - ga_w
                    llama_cpp.llama_memory_seq_add(mem, 0, ga_i, n_past, ib * bd)
                    seq_div(mem, ga_i + ib * bd, ga_i + ib * bd + ga_w, ga_n, seq_div_mode)
                    llama_cpp.llama_memory_seq_add(mem, 0, ga_i + ib * bd + ga_w, n_past + ib * bd, dd)
                    n_past -= bd
                    ga_i += ga_w // ga_n
                if n_past + len(chunk) > n_ctx_real - 4:
                    raise SystemExit(f"grouped attention ran out of context at n_past={n_past}")
            # llama-cli lets llama_decode place the batch after the cache's last position: check it is n_past.
            last = llama_cpp.llama_memory_seq_pos_max(mem, 0)
            if last + 1 != n_past:
                raise SystemExit(f"cache ends at position {last}, expected {n_past - 1}")
            batch.n_tokens = len(chunk)
            for k, token in enumerate(chunk):
                batch.token[k] = int(token)
                batch.pos[k] = n_past + k
                batch.n_seq_id[k] = 1
                batch.seq_id[k][0] = 0
                batch.logits[k] = 1  # an output for every token: each predicts the next one
            status = llama_cpp.llama_decode(ctx, batch)
            if status != 0:
                raise SystemExit(f"llama_decode returned {status} at token {start}")
            positions_seen.append([start, n_past, n_past + len(chunk) - 1])
            n_past += len(chunk)
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(ctx), shape=(len(chunk), vocab))
            scored = min(len(chunk), n - 1 - start)  # the last token predicts nothing
            losses[start : start + scored] = row_losses(logits[:scored], ids[start + 1 : start + 1 + scored])
            print(f"[worker] {start + len(chunk)}/{n} tokens, {time.time() - started:.0f}s", file=sys.stderr, flush=True)
    finally:
        llama_cpp.llama_batch_free(batch)
    elapsed = time.time() - started
    if not np.isfinite(losses).all():
        raise SystemExit("non-finite losses")
    np.save(job["out"], losses)
    meta = {
        "model": job["model"],
        "args": list(job["args"]),
        "context_params": params,
        "n_ctx_requested": n_ctx,
        "n_ctx": n_ctx_real,
        "n_ctx_seq": n_ctx_seq,
        "n_ctx_train": llama_cpp.llama_model_n_ctx_train(model),
        "n_batch": n_batch,
        "n_ubatch": n_ubatch,
        "kv_type": job.get("kv_type", "f32"),
        "flash_attn": bool(job.get("flash_attn", False)),
        "grp_attn": {"n": ga_n, "w": ga_w, "seq_div": seq_div_mode} if ga_n != 1 else None,
        "batches": positions_seen,  # [first token, first position, last position] of each batch
        "tokens": n,
        "seconds": elapsed,
        "llama_cpp_python": llama_cpp.__version__,
        "gguf_metadata": gguf_metadata(model),
    }
    with open(job["meta"], "w") as handle:
        json.dump(meta, handle, indent=1)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
