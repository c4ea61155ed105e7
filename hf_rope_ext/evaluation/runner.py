"""Run many methods x scales in one process: the model is loaded once and patched per case.

Every finished case is appended to ``<output_dir>/results.jsonl`` at once (schema and store:
:mod:`.records`), so an interrupted run loses at most the case it was in, and a rerun of the same
command skips every case already in the file. What to run: :mod:`.plan`; the documents:
:mod:`.documents`.

Identical cases are computed once: when a case would use exactly the rotary frequencies of a
finished case with the same data (for instance ``dynamic-yarn`` at any length inside the native
context, which is the unpatched model, or ``dynamic-yarn`` at scales 2 and 4, whose frequencies
follow the input length only), its numbers are copied and ``reused_from`` names the source.
"""

from __future__ import annotations

import hashlib
import json
import logging
import operator
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from .. import config_io, unpatch_model
from ..patching import _patch_to_put_back, _put_back, describe_record
from ..spec import PatchSpec
from ..rotary import ExtendedRotaryEmbedding
from .documents import check_documents, document_hash
from .perplexity import bucket_perplexity, default_boundaries, document_tensors, sliding_window_perplexity
from .plan import EvalPlan
from .records import (
    DTYPE_NAMES,
    EXACT_STEPS,
    NONE_METHOD,
    RECORD_FIELDS,
    STATE_FIELDS,
    EvaluationError,
    ResultStore,
    case_key,
    data_key,
    recorded_steps,
)
from .report import write_reports
from .retrieval import make_trial, retrieval_accuracy, trial_seed

logger = logging.getLogger(__name__)

__all__ = ["EvalPlan", "EvaluationError", "ResultStore", "run_evaluation", "case_key"]


# Config keys that do not change what the model computes.
_CONFIG_KEYS_IGNORED = ("transformers_version", "dtype", "torch_dtype", "architectures")


def _offloaded_copy(model: nn.Module, name: str) -> torch.Tensor | None:
    """The weights accelerate keeps (CPU or disk) for the parameter ``name`` that it offloaded to the
    meta device: its hook on the parameter's module, or on a module above it, maps the name
    relative to that module to them. None where no hook has it."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, -1, -1):
        hook = getattr(model.get_submodule(".".join(parts[:cut])), "_hf_hook", None)
        for part in getattr(hook, "hooks", (hook,)):  # a SequentialHook chains several
            weights = getattr(part, "weights_map", None)
            if weights is not None:
                try:
                    return weights[".".join(parts[cut:])]
                except KeyError:
                    pass
    return None


def _still_tied(model: nn.Module, name: str, target: str) -> bool:
    """Whether the offloaded copies of ``name`` and the parameter it is tied to hold the same weights
    (a config may declare a tie that a model replaced by a parameter of its own)."""
    copy, target_copy = _offloaded_copy(model, name), _offloaded_copy(model, target)
    if copy is None or target_copy is None or copy.shape != target_copy.shape:
        return False
    return copy is target_copy or torch.equal(copy.detach().cpu(), target_copy.detach().cpu())


def model_fingerprint(model: nn.Module, samples_per_tensor: int = 1024) -> str:
    """A short hash of the model's config and of its weights, 16 hex digits.

    The weights enter through every parameter's name and shape and ``samples_per_tensor``
    evenly spaced values (cheap even for large models; fine-tuned or other checkpoints differ
    there). A parameter accelerate offloaded (on the meta device) enters through the copy
    accelerate keeps of it; a meta parameter with no such copy (weights not loaded) is refused,
    as it would make every model of that shape the same. Keys starting with ``_`` (name or
    path, attention implementation) are left out.
    """
    config = model.config.to_dict()
    described = {key: value for key, value in config.items()
                 if not key.startswith("_") and key not in _CONFIG_KEYS_IGNORED}  # fmt: skip
    digest = hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode())
    # Names transformers ties to another parameter (lm_head.weight to the embeddings): in memory
    # they are one tensor, which named_parameters lists once; offloading to meta unties them.
    expand = getattr(model, "get_expanded_tied_weights_keys", None)
    tied = expand(all_submodels=True) if callable(expand) else {}
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.device.type == "meta" and name in tied and _still_tied(model, name, tied[name]):
                continue
            digest.update(f"{name}{tuple(parameter.shape)}".encode())
            if parameter.device.type == "meta":
                parameter = _offloaded_copy(model, name)
                if parameter is None:
                    raise ValueError(
                        f"{type(model).__name__}'s parameter {name} is on the meta device with no offloaded copy, so "
                        "the model cannot be told from another of its shape; load its weights first."
                    )
            if parameter.numel():
                flat = parameter.detach().reshape(-1)
                step = max(1, flat.numel() // samples_per_tensor)
                digest.update(flat[::step][:samples_per_tensor].to("cpu", torch.float64).numpy().tobytes())
    return digest.hexdigest()[:16]


def _check_same_inputs(store: ResultStore, model_name: str, dtype: str, fingerprint: str,
                       document_hashes: Mapping[str, str]) -> None:
    """Refuse a results folder whose records use the same names (or another spelling of the same
    local folder) for another model or text."""
    for record in store.records:
        recorded = record.get("model")
        if record.get("dtype") == dtype and (recorded == model_name or _same_folder(recorded, model_name)):
            if record.get("model_fingerprint") != fingerprint:
                raise EvaluationError(
                    f"{store.path} holds results of a model named {recorded!r} ({dtype}) whose config or weights "
                    f"differ from the model loaded now as {model_name!r} (fingerprint "
                    f"{record.get('model_fingerprint')} against {fingerprint}). Use another --output-dir for this model."
                )
        name = record.get("document")
        if record.get("kind") == "perplexity" and name in document_hashes:
            if record.get("document_sha256") != document_hashes[name]:
                raise EvaluationError(
                    f"{store.path} holds results for a document named {name!r} with other content (token hash "
                    f"{record.get('document_sha256')} against {document_hashes[name]} now). Rename the file, or use "
                    "another --output-dir."
                )


def _recorded_name(store: ResultStore, model_name: str, dtype: str, fingerprint: str) -> str:
    """The name under which ``store`` holds this model (same fingerprint and dtype) as another spelling
    of the same local folder (``ckpt``, ``./ckpt/``, its absolute path), else ``model_name``: those
    resume one set of cases. Other names stay apart, as two models whose fingerprints collide would
    (the fingerprint samples each weight tensor, so it alone cannot tell two names' models apart)."""
    for record in store.records:
        recorded = record.get("model")
        if (record.get("model_fingerprint") == fingerprint and record.get("dtype") == dtype and recorded != model_name
                and _same_folder(recorded, model_name)):
            logger.info("%s holds results of this model (fingerprint %s) under %r, the same folder as %r; they are "
                        "resumed under that name.", store.path, fingerprint, recorded, model_name)  # fmt: skip
            return recorded
    return model_name


def _same_folder(first: Any, second: Any) -> bool:
    """Whether two model names are spellings of one existing local folder."""
    if not isinstance(first, str) or not isinstance(second, str):
        return False
    try:
        a, b = Path(first).expanduser(), Path(second).expanduser()
        return a.is_dir() and b.is_dir() and a.resolve() == b.resolve()
    except (OSError, RuntimeError):
        return False


def rope_fingerprint(model: nn.Module, length: int) -> str:
    """A short hash of the rotary frequencies ``model`` uses for a ``length``-token input.

    ``"original"`` for the model's own RoPE: unpatched, or a length-dependent or attention-level
    method inside the native context (where it calls the original module). Attention-level
    methods and log-n attention add their position remap (where it applies at ``length``) and
    temperature to the hash.
    """
    rotary = next((module for module in model.modules() if isinstance(module, ExtendedRotaryEmbedding)), None)
    inside = rotary is not None and length <= rotary.original_max_seq_len
    if rotary is None or (inside and rotary.original_module_exact):  # the model's own module runs there
        return "original"
    inv_freq, attention_factor = rotary.frequencies(length)
    attention = rotary.attention_patch
    position_remap = attention.remap_for(rotary.remap_applies(length)) if attention is not None else None
    # No remap at this length and no temperature: the frequencies alone say what the model computes.
    plain = attention is None or (position_remap is None and not attention.logn)
    remap = "" if plain else f"{position_remap!r} logn={attention.logn}"
    digest = hashlib.sha1(inv_freq.double().numpy().tobytes() + repr(float(attention_factor)).encode() + remap.encode())
    return digest.hexdigest()[:16]


@dataclass
class _Case:
    spec: dict[str, Any]  # identity fields
    label: str

    @property
    def key(self) -> str:
        return case_key(self.spec)


def _cases(plan: EvalPlan, method: str, scale: float | None, model_name: str, model_print: str, dtype: str,
           document_hashes: Mapping[str, str], native_context: int) -> list[_Case]:
    cases = []
    steps = recorded_steps(method, plan.steps_per_doubling)
    common = {"method": method, "scale": scale, "steps_per_doubling": steps, "model": model_name,
              "model_fingerprint": model_print, "dtype": dtype}  # fmt: skip
    state = method if scale is None else f"{method} x{scale:g}"
    if steps is not None:
        state += f" [steps_per_doubling={steps}]" if steps != EXACT_STEPS else " [exact length]"
    bucket_size = plan.bucket_size or max(native_context // 4, 1)
    for mode in plan.ppl_modes if plan.ppl_lengths else []:
        for length in plan.ppl_lengths:
            for name, content_hash in document_hashes.items():
                spec = {"kind": "perplexity", "mode": mode, **common, "document": name,
                        "document_sha256": content_hash, "context_length": length,
                        "stride": None, "eval_tokens": None, "bucket_size": None}  # fmt: skip
                if mode == "buckets":
                    spec["bucket_size"] = bucket_size
                else:
                    spec["stride"] = plan.stride
                    spec["eval_tokens"] = plan.sliding_tokens or max(plan.ppl_lengths)
                cases.append(_Case(spec, f"{state} ppl/{mode} {name} L={length}"))
    for task in plan.retrieval_tasks:
        for length in plan.retrieval_lengths:
            for depth in plan.depths:
                spec = {"kind": "retrieval", "task": task, **common, "length": length, "depth": float(depth),
                        "trials": plan.trials, "seed": plan.seed,
                        "needle_count": plan.needle_count if task == "needle" else None,
                        "max_new_tokens": plan.max_new_tokens}  # fmt: skip
                cases.append(_Case(spec, f"{state} {task} L={length} depth={depth:g}"))
    return cases


def _fingerprint_of(model: nn.Module, spec: Mapping[str, Any]) -> str:
    if spec["kind"] == "perplexity":
        return rope_fingerprint(model, spec["context_length"])
    prompt = spec["length"] - spec["max_new_tokens"]
    first, last = rope_fingerprint(model, prompt), rope_fingerprint(model, spec["length"])
    return first if first == last else f"{first}+{last}"


def _check_stored_frequencies(model: nn.Module, store: ResultStore, groups, plan: EvalPlan,
                              native_context: int) -> None:
    """Refuse finished cases whose rotary frequencies differ from those the patch gives now.

    A method's parameters are not part of a case's name: a method registered again with other
    defaults, or a built-in whose defaults changed between versions, would otherwise count as done
    and report the old numbers. Records without a RoPE fingerprint are taken as they are.
    """
    for method, scale, cases in groups:
        done = [(case, store.get(case.key)) for case in cases if case.key in store]
        done = [(case, record) for case, record in done if isinstance(record.get("rope_fingerprint"), str)]
        if not done:
            continue
        if method != NONE_METHOD:
            PatchSpec.for_configuration(method, scale, original_max_length=native_context,
                                        steps_per_doubling=plan.steps_per_doubling).apply(model)  # fmt: skip
        try:
            for case, record in done:
                now = _fingerprint_of(model, case.spec)
                if record["rope_fingerprint"] != now:
                    raise EvaluationError(
                        f"{case.label}: {store.path} holds this case computed with other rotary frequencies (RoPE "
                        f"fingerprint {record['rope_fingerprint']}, now {now}): the method's parameters or code "
                        "changed since. Use another --output-dir for the new numbers."
                    )
        finally:
            if method != NONE_METHOD:
                unpatch_model(model)


def _check_inputs_fit(plan: EvalPlan, tokenizer, documents: Mapping[str, torch.Tensor]) -> None:
    """The checks of a plan that need the tokenizer, before any forward: windows that start with
    BOS leave ``L - 1`` document tokens for the stride, and every retrieval prompt must hold its
    instruction, needles and question (built here as the cases will build them; tokenizing only)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if "sliding" in plan.ppl_modes and plan.ppl_lengths and bos is not None:
        shortest = min(plan.ppl_lengths)
        if plan.stride > shortest - 1 and any(len(ids) and int(ids[0]) == bos for ids in documents.values()):
            raise EvaluationError(
                f"stride {plan.stride} must be at most {shortest - 1} when every window starts with BOS (a window of "
                f"{shortest} tokens holds {shortest - 1} document tokens); use a smaller --stride."
            )
    for task in plan.retrieval_tasks:
        length = min(plan.retrieval_lengths)
        for depth in plan.depths:
            rng = random.Random(trial_seed(plan.seed, task, length, depth))
            for _ in range(plan.trials):
                try:
                    make_trial(task, tokenizer, length - plan.max_new_tokens, depth, rng,
                               needle_count=plan.needle_count)  # fmt: skip
                except ValueError as error:
                    raise EvaluationError(f"{task} at {length} tokens ({plan.max_new_tokens} of them for the answer): "
                                          f"{error}") from None


def _run_case(model: nn.Module, tokenizer, plan: EvalPlan, spec: dict[str, Any],
              documents: Mapping[str, torch.Tensor], native_context: int, progress: bool = True) -> dict[str, Any]:
    if spec["kind"] == "perplexity":
        document = documents[spec["document"]]
        if spec["mode"] == "buckets":
            length = spec["context_length"]
            # Buckets split at the native context too, so that the positions beyond it have their own perplexity.
            boundaries = default_boundaries(length, spec["bucket_size"])
            boundaries = sorted({*boundaries, native_context} if native_context < length else boundaries)
            result = bucket_perplexity(model, [document], length, boundaries=boundaries,
                                       chunk_size=plan.chunk_size)  # fmt: skip
            return {"buckets": [list(bucket) for bucket in result.bucket_ppls()], "ppl": result.ppl,
                    "nll": result.nll, "tokens": result.tokens, "windows": 1}  # fmt: skip
        result = sliding_window_perplexity(
            model, [document], spec["context_length"], stride=spec["stride"], max_tokens=spec["eval_tokens"],
            bos_token_id=getattr(tokenizer, "bos_token_id", None), chunk_size=plan.chunk_size, progress=progress,
        )
        return {"buckets": None, "ppl": result.ppl, "nll": result.nll, "tokens": result.tokens,
                "windows": result.windows}  # fmt: skip
    result = retrieval_accuracy(
        model, tokenizer, spec["task"], spec["length"], spec["depth"], trials=spec["trials"], seed=spec["seed"],
        needle_count=spec["needle_count"] or plan.needle_count, max_new_tokens=spec["max_new_tokens"],
        progress=progress,
    )
    return {"correct": result.correct, "accuracy": result.accuracy, "answers": result.answers,
            "outputs": result.outputs}  # fmt: skip


def _check_record_arguments(documents: Mapping[Any, Any], model_name: Any, dtype: Any, native_context: Any) -> int:
    """Refuse, before any forward, an argument of :func:`run_evaluation` that would be written into
    every record as a value the results' reader (:data:`.records.RECORD_FIELDS`) refuses: the run
    would be lost, and the folder refused until the lines were edited. Returns ``native_context``
    as an integer (``32.0`` or a NumPy integer are taken for ``32``)."""
    if isinstance(native_context, float) and native_context.is_integer():
        native_context = int(native_context)
    elif not isinstance(native_context, bool) and hasattr(native_context, "__index__"):
        try:
            native_context = operator.index(native_context)
        except TypeError:  # a float tensor: refused below, in one line
            pass
    perplexity_fields = RECORD_FIELDS["perplexity"]
    for argument, field, values in (("documents' names (its keys)", "document", list(documents)),
                                    ("model_name", "model", [model_name]), ("dtype", "dtype", [dtype]),
                                    ("native_context", "native_context", [native_context])):  # fmt: skip
        _, valid, expected = perplexity_fields[field]
        for value in values:
            if not valid(value):
                raise EvaluationError(f"{argument} must be {expected.removesuffix(' or null')}, got {value!r}.")
    return native_context


def run_evaluation(
    model: nn.Module,
    tokenizer,
    plan: EvalPlan,
    output_dir: str | Path,
    *,
    documents: Mapping[str, torch.Tensor] | None = None,
    model_name: str | None = None,
    dtype: str | torch.dtype | None = None,
    native_context: int | None = None,
    write_report: bool = True,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Evaluate every (method, scale) of ``plan`` on ``model``; returns the records of this plan.

    Cases already in ``<output_dir>/results.jsonl`` are skipped; a model is matched by content
    (:func:`model_fingerprint`), so results recorded under another ``model_name`` for the same
    model and dtype (``./ckpt/`` for ``ckpt``) are resumed under the name they have there.
    Every configuration is built from the model's original RoPE: a model the caller patched is
    evaluated from the RoPE it had before its patch (native context: the patch's original), and
    ``none`` is that original model. The model is patched with :func:`hf_rope_ext.patch_model`
    for each configuration and left afterwards as it came (its own patch, if any, put back),
    also when a case fails or the run is interrupted. A model loaded from a patched checkpoint
    with plain ``from_pretrained`` (its config holds the patched RoPE) is refused before any
    forward: load it with :func:`hf_rope_ext.hub.load_patched`. Reports
    (:func:`hf_rope_ext.evaluation.report.write_reports`) are rewritten at the end, also after
    an interruption.

    ``documents`` (name: token ids), ``model_name``, ``dtype`` and ``native_context`` are written
    into every record: a value the records cannot hold (a name that is not a non-empty string, a
    native context that is not a positive integer) raises :class:`EvaluationError` before any
    forward. A ``torch.dtype`` is recorded as ``"float32"``, as the model's own dtype by default.
    """
    previous = _patch_to_put_back(model)  # refuses a patch that could not be put back
    if previous is None:
        _check_not_loaded_patched(model)
    elif native_context is None:
        native_context = previous.spec.original_max_position_embeddings
    try:
        if previous is not None:  # every configuration starts from the original RoPE; 'none' is that model
            unpatch_model(model)
        return _run_evaluation(model, tokenizer, plan, output_dir, documents, model_name, dtype, native_context,
                               write_report, progress)  # fmt: skip
    finally:
        _put_back(model, previous)  # the caller's patch (or none), as patched() and check_configurations do


def _check_not_loaded_patched(model: nn.Module) -> None:
    """Refuse an unpatched model whose config holds a patch record: loaded from a patched checkpoint
    with plain from_pretrained, it computes the patched RoPE, which 'none' would be recorded as."""
    config = getattr(model, "config", None)
    record = None if config is None else config_io.read_record(config)  # a present null: refused as edited
    if record is not None:
        raise EvaluationError(
            f"This model was loaded from a checkpoint saved with an hf_rope_ext patch ({describe_record(record)}) "
            "without restoring it, so its config holds the patched RoPE; load it with hf_rope_ext.hub.load_patched "
            "(or call hf_rope_ext.hub.restore_patch(model)), and run_evaluation evaluates it from its original RoPE."
        )


def _run_evaluation(model, tokenizer, plan, output_dir, documents, model_name, dtype, native_context, write_report,
                    progress) -> list[dict[str, Any]]:
    """run_evaluation on the unpatched model."""
    if native_context is None:
        native_context = int(model.config.max_position_embeddings)
    model_name = model_name or str(getattr(model.config, "_name_or_path", "") or type(model).__name__)
    # One name per dtype, the command line's (--dtype fp32/bf16/fp16): the dtype is part of a case's key.
    if dtype is None:
        dtype = next(model.parameters()).dtype
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).replace("torch.", "")
    dtype = DTYPE_NAMES.get(dtype, dtype)
    native_context = _check_record_arguments(documents or {}, model_name, dtype, native_context)
    # Lists, arrays and (1, n) tensors as tokenizers return them: 1-D tensors from here on.
    documents = dict(zip(documents, document_tensors(list(documents.values())))) if documents else {}
    plan.validate(native_context)
    check_documents(plan, documents)
    _check_inputs_fit(plan, tokenizer, documents)

    store = ResultStore(output_dir)
    document_hashes = {name: document_hash(ids) for name, ids in documents.items()}
    model_print = model_fingerprint(model)
    model_name = _recorded_name(store, model_name, dtype, model_print)
    _check_same_inputs(store, model_name, dtype, model_print, document_hashes)
    logger.info("Cases are matched by content: documents by a hash of their tokens (%s), the model by its config and "
                "weights (fingerprint %s).", ", ".join(f"{name} {value}" for name, value in document_hashes.items())
                or "no documents", model_print)  # fmt: skip
    by_data_key = {data_key(record): record for record in store.records if "rope_fingerprint" in record}
    groups = [(method, scale, _cases(plan, method, scale, model_name, model_print, dtype, document_hashes,
                                     native_context))
              for method, scale in plan.configurations()]  # fmt: skip
    planned = [case for _, _, cases in groups for case in cases]
    _check_stored_frequencies(model, store, groups, plan, native_context)
    pending = sum(case.key not in store for case in planned)
    logger.info("%d cases planned, %d already in %s, %d to run.", len(planned), len(planned) - pending, store.path,
                pending)  # fmt: skip
    bar = tqdm(total=pending, desc="evaluation", unit="case", disable=not progress or pending == 0)
    try:
        for method, scale, cases in groups:
            todo = [case for case in cases if case.key not in store]
            if not todo:
                continue
            if method != NONE_METHOD:
                PatchSpec.for_configuration(method, scale, original_max_length=native_context,
                                            steps_per_doubling=plan.steps_per_doubling).apply(model)
            try:
                for case in todo:
                    bar.set_postfix_str(case.label)
                    fingerprint = _fingerprint_of(model, case.spec)
                    record = {**case.spec, "native_context": native_context, "rope_fingerprint": fingerprint}
                    source = by_data_key.get(data_key(record)) if plan.reuse_identical else None
                    if source is not None:
                        results = {key: value for key, value in source.items() if key not in record}
                        results["seconds"] = 0.0
                        origin = source.get("reused_from") or {name: source.get(name) for name in STATE_FIELDS}
                        results["reused_from"] = origin
                        logger.info("%s: same rotary frequencies as %s x%s; numbers reused.", case.label,
                                    source["method"], source["scale"])  # fmt: skip
                    else:
                        started = time.perf_counter()
                        results = _run_case(model, tokenizer, plan, case.spec, documents, native_context, progress)
                        results["seconds"] = round(time.perf_counter() - started, 2)
                        results["reused_from"] = None
                    record.update(results)
                    store.append(record)
                    by_data_key.setdefault(data_key(record), record)
                    logger.info("%s: %s", case.label, _short_result(record))
                    bar.update(1)
            finally:
                if method != NONE_METHOD:
                    unpatch_model(model)
    finally:
        bar.close()
        if write_report and store.records:
            write_reports(output_dir)
    keys = {case.key for case in planned}
    return [record for record in store.records if case_key(record) in keys]


def _short_result(record: Mapping[str, Any]) -> str:
    if record["kind"] == "perplexity":
        return f"ppl {record['ppl']:.3f}"
    return f"{record['correct']}/{record['trials']} correct"
