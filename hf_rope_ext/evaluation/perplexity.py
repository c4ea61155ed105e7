"""Perplexity of long documents, computed without a logits tensor over all positions.

Definitions (natural logarithms; a document is the token ids ``x_0 .. x_{N-1}``, where ``x_0``
is the tokenizer's BOS token when it has one):

* **Token loss.** ``l_t = -log p(x_t | x_0 .. x_{t-1})`` for ``t >= 1`` (``x_0`` is never
  predicted).
* **Bucket perplexity at context length L** (``mode="buckets"``). One forward over the first
  ``L`` tokens. For a bucket ``[a, b)`` of positions, ``ppl = exp(mean(l_t for a <= t < b, t >= 1))``;
  the overall perplexity is ``exp(mean(l_t for 1 <= t < L))``. This is the YaRN paper's
  perplexity of documents "truncated to the evaluation context window size" (Peng et al. 2023,
  arXiv 2309.00071, sec. 4.3.1), and the buckets show where in the window the loss rises.
* **Sliding-window perplexity** (``mode="sliding"``; Press et al. 2022, arXiv 2108.12409; used
  with stride ``S = 256`` by Position Interpolation, Chen et al. 2023, arXiv 2306.15595). Over the
  first ``N`` tokens of the document, windows of ``L`` tokens start every ``S`` tokens (the last
  one is moved back to end at ``N``, so every window holds ``L`` tokens). Each window scores only
  the tokens no earlier window scored, so with ``S < L`` (or BOS, below) every token but the
  first is scored exactly once, with at least ``L - S`` tokens of context after the first window.
  When the document starts with BOS, every window starts with BOS followed by ``L - 1``
  document tokens (as the YaRN and PI evaluation code does). ``ppl = exp(sum(l_t) / count)``,
  weighted by tokens (the YaRN script averages per-window means instead; the two differ only in
  the weight of the first window).

Memory: the decoder runs once to give the final hidden states; the LM head and the cross-entropy
run on ``chunk_size`` positions at a time, so a 100k-token input never holds a
``(100k, vocab)`` logits tensor.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from .summary import safe_exp

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_SIZE = 1024

__all__ = [
    "BucketPerplexity",
    "SlidingPerplexity",
    "bucket_perplexity",
    "buckets_of_losses",
    "document_tensors",
    "sliding_window_perplexity",
    "token_losses",
]


@dataclass
class BucketPerplexity:
    """Loss sums per position bucket of one or more documents at one context length."""

    context_length: int
    boundaries: list[int]  # bucket i is [boundaries[i], boundaries[i + 1])
    nll_sums: list[float]
    token_counts: list[int]

    @property
    def nll(self) -> float:
        return sum(self.nll_sums) / max(sum(self.token_counts), 1)

    @property
    def ppl(self) -> float:
        return safe_exp(self.nll)

    @property
    def tokens(self) -> int:
        return sum(self.token_counts)

    def bucket_ppls(self) -> list[tuple[int, int, float]]:
        """``(start, end, ppl)`` per bucket."""
        spans = zip(self.boundaries[:-1], self.boundaries[1:], self.nll_sums, self.token_counts)
        return [(start, end, safe_exp(total / count) if count else float("nan")) for start, end, total, count in spans]


@dataclass
class SlidingPerplexity:
    """Sliding-window loss over one or more documents."""

    context_length: int
    stride: int
    nll_sum: float = 0.0
    tokens: int = 0
    windows: int = 0
    eval_tokens: list[int] = field(default_factory=list)  # tokens of each document covered by the windows

    @property
    def nll(self) -> float:
        return self.nll_sum / max(self.tokens, 1)

    @property
    def ppl(self) -> float:
        return safe_exp(self.nll)


# ----------------------------------------------------------------------------------------------
# Chunked loss
# ----------------------------------------------------------------------------------------------


def _decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    get_decoder = getattr(model, "get_decoder", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    decoder = get_decoder() if callable(get_decoder) else None
    if decoder is None or head is None or decoder is model:
        raise ValueError(
            f"{type(model).__name__} is not a causal LM with a separate decoder and LM head "
            "(expected e.g. LlamaForCausalLM: model.get_decoder() and model.get_output_embeddings())."
        )
    return decoder, head


def _logits(model: nn.Module, head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``head(hidden)`` plus the output transforms some families apply after the head, in float32."""
    if getattr(head, "weight", None) is not None and hidden.device != (device := _execution_device(head)):
        hidden = hidden.to(device)
    logits = head(hidden).float()
    config = getattr(model, "config", None)
    scaling = getattr(config, "logits_scaling", None)  # granite divides the logits by a constant
    if scaling:
        logits = logits / scaling
    softcap = getattr(config, "final_logit_softcapping", None)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


_VERIFIED_HEADS: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _verify_head(model: nn.Module, decoder: nn.Module, head: nn.Module, device: torch.device) -> None:
    """Once per model: the decoder + head path must give the model's own logits.

    Catches families that change the logits in ways this module does not know about.
    """
    if model in _VERIFIED_HEADS:
        return
    probe = torch.arange(3, 11, device=device)[None] % max(int(getattr(model.config, "vocab_size", 11)), 1)
    with torch.no_grad():
        expected = model(input_ids=probe, use_cache=False).logits.float()
        hidden = decoder(input_ids=probe, use_cache=False).last_hidden_state
        ours = _logits(model, head, hidden)
    if not torch.isfinite(expected).all():
        # Not the head path's fault: the model itself gives NaN or infinite logits (bad weights, fp16 overflow).
        raise ValueError(
            f"{type(model).__name__} gives NaN or infinite logits on an 8-token input, so no loss can be computed; "
            "check its weights, or evaluate in a wider --dtype (fp32)."
        )
    if not torch.allclose(ours.to(expected.device), expected, atol=1e-3, rtol=1e-3):
        raise ValueError(
            f"{type(model).__name__}: computing logits as lm_head(decoder hidden states) does not reproduce "
            "the model's own logits, so the chunked loss would be wrong for this architecture."
        )
    _VERIFIED_HEADS.add(model)


def _execution_device(module: nn.Module) -> torch.device:
    """Where ``module`` computes: the device accelerate's hook runs it on when it is offloaded
    (its weights then sit on the meta device), else the device of its first parameter."""
    hook = getattr(module, "_hf_hook", None)
    for part in getattr(hook, "hooks", (hook,)):  # a SequentialHook chains several
        device = getattr(part, "execution_device", None)
        if device is not None and torch.device(device).type != "meta":
            return torch.device(device)
    parameters = list(module.parameters())
    return next((p.device for p in parameters if p.device.type != "meta"), parameters[0].device)


def _input_device(model: nn.Module) -> torch.device:
    return _execution_device(model.get_input_embeddings())


@torch.no_grad()
def token_losses(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    first_target: int = 1,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token losses ``l_t`` for ``t = first_target .. len(input_ids) - 1`` of one sequence.

    One forward of the decoder over the whole sequence (the model's RoPE sees the whole length,
    which matters for length-dependent methods), then the LM head and cross-entropy on
    ``chunk_size`` positions at a time. Returns a float32 CPU tensor of
    ``len(input_ids) - first_target`` losses. The model is measured in eval mode (no dropout) and
    left in its own modes.

    Args:
        model: a causal LM (``*ForCausalLM``, possibly patched or wrapped by peft).
        input_ids: 1-D (or ``(1, n)``) token ids.
        first_target: the first position whose token is scored (>= 1); earlier positions are
            context only and skip the LM head.
        chunk_size: positions per LM-head call; memory is ``chunk_size * vocab`` floats.
        position_ids: optional 1-D position of each token (default ``0 .. n - 1``); with gaps,
            a short input probes long distances, as in PoSE (Zhu et al. 2024, arXiv 2309.10400).
    """
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(f"token_losses takes one sequence, got a batch of {ids.shape[0]}.")
        ids = ids[0]
    length = ids.shape[0]
    if not 1 <= first_target < length:
        raise ValueError(f"first_target must be in [1, {length - 1}] for {length} tokens, got {first_target}.")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of positions, got {chunk_size}.")
    decoder, head = _decoder_and_head(model)
    device = _input_device(model)
    with eval_mode(model):
        return _token_losses(model, decoder, head, device, ids, first_target, chunk_size, position_ids)


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """Every module in eval mode during a measurement (with dropout on, a loss is noise), each
    module's own mode put back afterwards, also when it fails."""
    modes = {module: module.training for module in model.modules()}
    try:
        for module in modes:
            module.training = False
        yield
    finally:
        for module, training in modes.items():
            module.training = training


def _token_losses(model, decoder, head, device, ids, first_target, chunk_size, position_ids) -> torch.Tensor:
    length = ids.shape[0]
    _verify_head(model, decoder, head, device)
    extra = {}
    if position_ids is not None:
        position_ids = torch.as_tensor(position_ids).reshape(-1)
        if position_ids.shape != ids.shape:
            raise ValueError(f"position_ids has {position_ids.numel()} entries for {length} tokens.")
        extra["position_ids"] = position_ids[None].to(device)
        # Without an attention mask transformers reads jumps in position_ids as boundaries of packed
        # sequences and masks attention across them; a full mask keeps one sequence.
        extra["attention_mask"] = torch.ones(1, length, dtype=torch.long, device=device)
    hidden = decoder(input_ids=ids[None].to(device), use_cache=False, **extra).last_hidden_state[0]
    targets = ids.to(hidden.device)
    losses = []
    # Position p's logits predict token p + 1.
    for start in range(first_target - 1, length - 1, chunk_size):
        end = min(start + chunk_size, length - 1)
        logits = _logits(model, head, hidden[start:end])
        chunk_targets = targets[start + 1 : end + 1].to(logits.device)
        losses.append(nn.functional.cross_entropy(logits, chunk_targets, reduction="none").cpu())
    return torch.cat(losses)


def _count(value, name: str, minimum: int) -> int:
    """``value`` as an int (numpy and 0-d tensor integers too), refusing floats, bools and small values."""
    try:
        number = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        number = None
    if number is None or number < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    return number


def document_tensors(documents: Sequence) -> list[torch.Tensor]:
    """The documents as 1-D id tensors (a ``(1, n)`` tensor, as tokenizers return, lists and arrays too)."""
    if len(documents) == 0:
        raise ValueError("No documents given: a perplexity needs at least one document of token ids.")
    tensors = []
    for index, document in enumerate(documents):
        ids = torch.as_tensor(document)
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex():
            raise ValueError(f"Document {index} must be a 1-D sequence of token ids, got shape {tuple(ids.shape)} "
                             f"of {ids.dtype}.")  # fmt: skip
        tensors.append(ids)
    return tensors


def _check_context_length(context_length: int, available: int, what: str, name: str = "context_length") -> None:
    _count(context_length, name, 2)
    if available < context_length:
        raise ValueError(
            f"{what} has {available} tokens, fewer than the requested context length of {context_length}; "
            "use a longer document or a shorter length."
        )


def default_boundaries(context_length: int, bucket_size: int) -> list[int]:
    """``[0, b, 2b, ..., context_length]`` (the last bucket may be shorter)."""
    if bucket_size < 1:
        raise ValueError(f"bucket_size must be a positive number of tokens, got {bucket_size}.")
    return list(range(0, context_length, bucket_size)) + [context_length]


def bucket_perplexity(
    model: nn.Module,
    documents: Sequence[torch.Tensor],
    context_length: int,
    *,
    bucket_size: int | None = None,
    boundaries: Sequence[int] | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> BucketPerplexity:
    """Loss by position bucket from one forward over the first ``context_length`` tokens of
    each document (definition in the module docstring); documents are pooled by tokens.

    Give ``bucket_size`` (equal buckets) or explicit ``boundaries`` (``0 .. context_length``).
    """
    context_length = _count(context_length, "context_length", 2)
    documents = document_tensors(documents)
    if boundaries is None:
        size = context_length if bucket_size is None else _count(bucket_size, "bucket_size", 1)
        boundaries = default_boundaries(context_length, size)
    boundaries = [_count(b, "each boundary", 0) for b in boundaries]
    rising = all(a < b for a, b in zip(boundaries, boundaries[1:]))
    if len(boundaries) < 2 or boundaries[0] != 0 or boundaries[-1] != context_length or not rising:
        raise ValueError(f"boundaries must rise strictly from 0 to context_length={context_length}, got {boundaries}.")
    sums = [0.0] * (len(boundaries) - 1)
    counts = [0] * (len(boundaries) - 1)
    for index, document in enumerate(documents):
        _check_context_length(context_length, len(document), f"Document {index}")
        losses = token_losses(model, document[:context_length], chunk_size=chunk_size).double()
        one = buckets_of_losses(losses.numpy(), boundaries)
        sums = [a + b for a, b in zip(sums, one.nll_sums)]
        counts = [a + b for a, b in zip(counts, one.token_counts)]
    return BucketPerplexity(context_length, boundaries, sums, counts)


def buckets_of_losses(losses: Sequence[float], boundaries: Sequence[int]) -> BucketPerplexity:
    """Bucket one document's per-token losses ``l_1 .. l_{n-1}`` (``losses[i]`` scores token
    ``i + 1``, as :func:`token_losses` returns them) by position, exactly as
    :func:`bucket_perplexity` does; ``boundaries`` rise from 0 to ``n``. The comparisons with
    other runtimes use it, so their buckets are the evaluation tool's own.
    """
    import numpy as np

    values = np.asarray(losses, dtype=np.float64)
    boundaries = [int(b) for b in boundaries]
    if values.ndim != 1:
        raise ValueError(f"losses must be one document's 1-D sequence, got shape {values.shape}.")
    if boundaries[0] != 0 or boundaries[-1] != len(values) + 1 or any(a >= b for a, b in zip(boundaries, boundaries[1:])):
        raise ValueError(f"boundaries must rise strictly from 0 to {len(values) + 1} (the tokens), got {boundaries}.")
    sums, counts = [], []
    for start, end in zip(boundaries[:-1], boundaries[1:]):
        part = values[max(start, 1) - 1 : end - 1]  # values[i] is l_{i+1}; token 0 has no loss
        sums.append(float(part.sum()))
        counts.append(int(part.size))
    return BucketPerplexity(boundaries[-1], boundaries, sums, counts)


def sliding_windows(total: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """``(begin, end, scored)`` of each window over ``total >= window`` tokens: tokens
    ``[begin, end)`` are fed, and the last ``scored`` of them are new (no earlier window scored them).

    Windows start every ``stride`` tokens; the last one is moved back to end exactly at ``total``
    so that it, too, holds ``window`` tokens of context.
    """
    if stride < 1 or stride > window:
        raise ValueError(f"stride must be between 1 and the window length {window}, got {stride}.")
    if total < window:
        raise ValueError(f"{total} tokens do not fill one window of {window}.")
    spans = []
    previous_end = 0
    begin = 0
    while previous_end < total:
        end = min(begin + window, total)
        spans.append((end - window, end, end - previous_end))
        previous_end = end
        begin += stride
    return spans


def sliding_window_perplexity(
    model: nn.Module,
    documents: Sequence[torch.Tensor],
    context_length: int,
    *,
    stride: int = 256,
    max_tokens: int | None = None,
    bos_token_id: int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    progress: bool = True,
) -> SlidingPerplexity:
    """Sliding-window perplexity (definition in the module docstring).

    Args:
        documents: 1-D token id tensors. A document starting with ``bos_token_id`` has every
            window start with BOS followed by ``context_length - 1`` document tokens.
        context_length: window length ``L`` in tokens (BOS included).
        stride: ``S``, how far each window moves; the number of forwards is about
            ``(N - L) / S + 1`` per document.
        max_tokens: score only the first ``N`` tokens of each document (default: all of it).
    """
    context_length = _count(context_length, "context_length", 2)
    stride = _count(stride, "stride", 1)
    max_tokens = None if max_tokens is None else _count(max_tokens, "max_tokens", 2)
    result = SlidingPerplexity(context_length, stride)
    for index, document in enumerate(document_tensors(documents)):
        if max_tokens is not None:
            _check_context_length(context_length, max_tokens, f"max_tokens={max_tokens}")
            _check_context_length(max_tokens, len(document), f"Document {index}", "max_tokens")
            document = document[:max_tokens]
        _check_context_length(context_length, len(document), f"Document {index}")
        has_bos = bos_token_id is not None and int(document[0]) == bos_token_id
        body = document[1:] if has_bos else document
        prefix = document[:1] if has_bos else document[:0]
        if has_bos and stride > context_length - 1:
            raise ValueError(
                f"stride must be at most {context_length - 1} when every window starts with BOS (a window holds "
                f"{context_length - 1} document tokens), got {stride}."
            )
        spans = sliding_windows(len(body), context_length - len(prefix), stride)
        bar = tqdm(spans, desc=f"sliding windows (L={context_length})", leave=False, disable=not progress)
        for begin, end, scored in bar:
            window = torch.cat((prefix, body[begin:end]))
            # Without BOS the window's first token cannot be predicted.
            scored = min(scored, len(window) - 1)
            losses = token_losses(model, window, first_target=len(window) - scored, chunk_size=chunk_size)
            result.nll_sum += float(losses.double().sum())
            result.tokens += losses.numel()
            result.windows += 1
        result.eval_tokens.append(len(document))
    return result
