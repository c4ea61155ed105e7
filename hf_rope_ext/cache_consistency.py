"""Keep the KV cache exact for length-dependent RoPE methods.

A full forward pass over ``N`` tokens computes every token's keys and values with the
frequencies of one length. During generation the cache holds states computed when the
sequence was shorter. transformers' ``dynamic`` type changes the frequencies at every step and
keeps the stale states (transformers issue 25104), so generation differs from a full forward.
Re-rotating the cached keys is not enough either: from the second layer on, the cached keys and
values are outputs of attention that ran with the old frequencies.

What this module does instead: choose the frequencies once for the length a sequence is
planned to reach, and recompute the cached states (a prefill of the tokens seen so far) only
when the sequence goes past it.

- The planned length: inside ``generate``, the prompt plus ``max_new_tokens`` (a per-instance
  wrapper of ``generate`` reads it before the prefill; see :func:`planned_length` for other
  loops); otherwise the length of the sequence itself, so a single forward over ``L`` tokens
  uses the frequencies of ``L``.
- The frequencies of a cache are those of the planned length when it was filled. A later call
  that continues the cache keeps them while the sequence fits, and past it recomputes the
  cache once with the frequencies of the new planned length (without a plan, of the length
  rounded up to ``steps_per_doubling`` steps per doubling, so a hand-written decode loop
  recomputes at most that many times per doubling; with ``None``, at every token).

Every logit is therefore that of one full forward over the same tokens with the frequencies in
use, i.e. of ``max(planned length, tokens so far)``: ``with planned_length(model, P): model(ids)``
reproduces them.

Mechanism (:class:`PrefixRecompute`): two forward hooks on the module that calls the rotary
embedding (the base model). The pre-hook tells the rotary module which length's frequencies to
use and, when they must change, empties the cache and hands the forward the whole logged
sequence; the post-hook cuts the outputs back to the tokens of the call and records what the
cache now holds (:mod:`hf_rope_ext.cache_log`, which also follows the cache's batch operations).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import GenerationMixin

from . import compat
from .cache_log import CacheLogs, FilledCaches, InputLog, foreign_cache_error
from .forward_threads import ForwardThreads
from .rotary import ExtendedRotaryEmbedding
from .validation import check_context, check_length

logger = logging.getLogger(__name__)


@dataclass
class _Call:
    """One forward of the hooked module, from its pre-hook to its post-hook."""

    kwargs: dict  # the keyword arguments its forward gets: the post-hook's own (or a later pre-hook's)
    cache: Any
    log: InputLog | None  # what the cache holds after the forward (None: nothing to record)
    new_tokens: int
    recomputed: bool
    frequency_length: int | None  # length whose frequencies this forward uses (None: the original)


class PrefixRecompute:
    """The pair of hooks that keeps caches exact for one patched rotary module, by re-running
    the prefix written to a cache when its frequencies must change.

    ``model`` is what was patched: ``generate`` of each transformers generation model in it
    (normally one) gets a per-instance wrapper that announces the planned length.
    ``logs`` holds the :class:`InputLog` of each cache these hooks filled.
    """

    def __init__(self, caller: nn.Module, rotary: ExtendedRotaryEmbedding, model: nn.Module | None = None):
        self.caller = caller
        self.rotary = rotary
        self.signature = inspect.signature(caller.forward)
        self.cache_name = compat.cache_argument_name(self.signature.parameters)
        needed = {"input_ids", "inputs_embeds", "position_ids"}
        missing = sorted(needed - set(self.signature.parameters)) + ([] if self.cache_name else ["cache"])
        if missing:
            raise ValueError(
                f"{type(caller).__name__}.forward lacks {missing}; length-dependent methods need them to keep "
                "the KV cache exact. Use a static method (linear, ntk, yarn, llama3)."
            )
        self.logs = CacheLogs()
        # Forwards under way, innermost last: a forward can run inside another (a hook that calls
        # the model), and each post-hook must see its own call. One thread at a time: the rotary
        # module's frequency_length is shared, so another thread's forward meanwhile is refused.
        self._calls: list[_Call] = []
        self.forward_threads = ForwardThreads()
        self.planned_length: int | None = None
        # (config, value) while a generate call has raised config.max_position_embeddings
        self.context_before_generate: tuple[Any, int] | None = None
        self.recomputations = 0  # prefix recomputations since patching (for benchmarks and tests)
        self._warned_unplanned = False
        self.handles = [
            caller.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            caller.register_forward_hook(self._after_forward, with_kwargs=True, always_call=True),
        ]
        self._generate_wrapped = _wrap_generate(model if model is not None else caller)

    def __deepcopy__(self, memo: dict) -> PrefixRecompute:
        copied = object.__new__(type(self))
        memo[id(self)] = copied
        for name, value in vars(self).items():
            setattr(copied, name, copy.deepcopy(value, memo))
        # A plan, and the context a generate raised in the config, belong to a call under way on
        # the original (a generate on another thread while the model is copied, as the refusal
        # advises): the copy starts with neither.
        copied.planned_length = None
        if copied.context_before_generate is not None:
            config, context = copied.context_before_generate
            config.max_position_embeddings = context
            copied.context_before_generate = None
        return copied

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for module in self._generate_wrapped:
            _unwrap_generate(module)
        self._generate_wrapped = []
        self.rotary.frequency_length = None

    @contextlib.contextmanager
    def planning(self, length: int | None) -> Iterator[None]:
        """Forwards inside use the frequencies of at least ``length`` tokens (None: no plan of
        its own; an enclosing plan still holds).

        The plan is stored on the patch, which all threads share, so the block holds the model for
        its thread: another thread's forward in a gap between this block's forwards would get the
        plan (refused, as an overlapping forward is), and so would its own plan (refused too)."""
        with self.forward_threads.held():
            previous = self.planned_length
            self.planned_length = previous if length is None else max(int(length), previous or 0)
            try:
                yield
            finally:
                self.planned_length = previous

    def _frequency_length(self, needed: int) -> int | None:
        """The length whose frequencies a sequence of ``needed`` tokens gets now (None: the original)."""
        return self.rotary.effective_length(max(needed, self.planned_length or 0))

    def _covered(self, effective: int | None) -> float:
        """How many tokens the frequencies of ``effective`` serve without a change."""
        return self.rotary.covered_length(effective)

    # -- hooks -------------------------------------------------------------------------------

    def _arguments(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        return compat.call_arguments(self.signature, args, kwargs)

    def _start(self, call: _Call) -> None:
        self._calls.append(call)
        self.rotary.frequency_length = call.frequency_length

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        if self.forward_threads.enter(module) == 1:
            self._calls.clear()  # none can be under way: left by an interrupted forward, or copied with the model
        arguments = self._arguments(args, kwargs)
        _, cache = compat.cache_argument(arguments)
        inputs = arguments.get("input_ids")
        if inputs is None:
            inputs = arguments.get("inputs_embeds")
        if inputs is None:
            self._start(_Call(kwargs, cache, None, 0, False, self.rotary.frequency_length))
            return None
        new_tokens = inputs.shape[1]
        past = cache.get_seq_length() if compat.is_cache(cache) else 0
        positions = arguments.get("position_ids")
        if positions is None:
            positions = torch.arange(past, past + new_tokens, device=inputs.device)[None]
        if positions.dim() != 2:
            raise ValueError(
                f"Length-dependent RoPE methods need 2-D position_ids (batch, seq); got shape {tuple(positions.shape)}."
            )
        mask = _padding_of_new_tokens(arguments.get("attention_mask"), past, new_tokens, inputs.device)
        needed = int(positions.max()) + 1
        log = self._synced_log(cache) if compat.is_cache(cache) else None
        if log is None:
            if past > 0:
                raise foreign_cache_error(past, 0, self.rotary.method.name, self.cache_name)
            frequency_length = self._frequency_length(needed)
            written = InputLog((inputs,), positions, mask, frequency_length)
            self._start(_Call(kwargs, cache, written, new_tokens, False, frequency_length))
            return None

        length = max(log.length, needed)
        if length <= self._covered(log.effective_length):
            # The sequence still fits the frequencies the cache was filled with: keep them.
            written = log.extended(inputs, positions, mask, log.effective_length)
            self._start(_Call(kwargs, cache, written, new_tokens, False, log.effective_length))
            return None

        # The frequencies change: recompute the cached states of the whole sequence with them.
        frequency_length = self._frequency_length(length)
        written = log.extended(inputs, positions, mask, frequency_length)
        all_inputs = self._joined(written.segments)
        logger.debug(
            "RoPE frequencies change at length %d (to those of %s tokens): recomputing the states of %d cached tokens.",
            length,
            frequency_length,
            log.width,
        )
        self.recomputations += 1
        if self.planned_length is None and self.rotary.steps_per_doubling is None and not self._warned_unplanned:
            self._warned_unplanned = True
            logger.warning(
                "A forward continued the KV cache past the %d tokens its RoPE frequencies were chosen for, so the "
                "cache of %d tokens is recomputed; without a planned length (a decode loop of your own, or `generate` "
                "of a model other than the one patched) this happens at every further token. Announce the final "
                "length with `hf_rope_ext.planned_length(model, n)`, generate through the model you patched, or patch "
                "with steps_per_doubling=1.",
                self._covered(log.effective_length),
                log.width,
            )
        cache.reset()
        self.logs.discard(cache)  # recorded again once the forward has refilled the cache
        is_embeddings = all_inputs.dim() == 3
        arguments["input_ids"] = None if is_embeddings else all_inputs
        arguments["inputs_embeds"] = all_inputs if is_embeddings else None
        arguments["position_ids"] = written.positions
        # A 2-D padding mask; transformers builds the 4-D mask that fits the cache and attention kernel.
        arguments["attention_mask"] = written.mask if bool((written.mask == 0).any()) else None
        for name in compat.CACHE_ARGUMENT_NAMES:  # the one name the forward declares (an old one is renamed)
            arguments.pop(name, None)
        arguments[self.cache_name] = cache
        self._start(_Call(arguments, cache, written, new_tokens, True, frequency_length))
        return (), arguments

    def _after_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any):
        # Nested forwards end first, so this forward's call is the innermost. After an error
        # (output None) the post-hook also runs when the pre-hook did not get to push a call:
        # then only its own kwargs identify one.
        if self.forward_threads.leave() == 0:  # its start was refused: another thread's forward runs
            return None
        if not self._calls or (output is None and self._calls[-1].kwargs is not kwargs):
            return None
        call = self._calls.pop()
        self.rotary.frequency_length = self._calls[-1].frequency_length if self._calls else None
        if output is None or call.log is None:
            # Nothing was written, or the forward failed: the cache keeps the log it had, which
            # a recomputation has already dropped with the cache's states.
            return None
        cache = call.cache if compat.is_cache(call.cache) else compat.output_cache(output)
        if compat.is_cache(cache):
            self.logs.set(cache, call.log)
        if call.recomputed:
            return self._keep_last(output, call.new_tokens)
        return None

    # -- helpers -----------------------------------------------------------------------------

    def _synced_log(self, cache: Any) -> InputLog | None:
        """The log of ``cache``, cut to the tokens it still holds (None: no log, or emptied)."""
        log = self.logs.get(cache)
        if log is None:
            return None
        cached = cache.get_seq_length()
        if cached < log.width:  # `cache.crop(...)` removed tokens from the end (assisted decoding), or `reset`
            if cached == 0:
                self.logs.discard(cache)
                return None
            log = log.cropped(cached)
            self.logs.set(cache, log)
        elif cached > log.width:
            raise foreign_cache_error(cached, log.width, self.rotary.method.name, self.cache_name)
        return log

    def _joined(self, segments: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The whole logged input in one tensor: ids, or embeddings where any run is embeddings."""
        if any(segment.dim() == 3 for segment in segments):
            device = next(segment.device for segment in segments if segment.dim() == 3)
            embed = self.caller.get_input_embeddings()
            segments = tuple(embed(segment.to(device)) if segment.dim() == 2 else segment for segment in segments)
        return torch.cat([segment.to(segments[0].device) for segment in segments], dim=1)

    @staticmethod
    def _keep_last(output: Any, new_tokens: int) -> Any:
        """Cut a recomputed forward's outputs back to the tokens the caller passed."""
        if hasattr(output, "last_hidden_state"):
            output.last_hidden_state = output.last_hidden_state[:, -new_tokens:]
            if getattr(output, "hidden_states", None) is not None:
                output.hidden_states = tuple(state[:, -new_tokens:] for state in output.hidden_states)
            if getattr(output, "attentions", None) is not None:
                output.attentions = tuple(weights[:, :, -new_tokens:] for weights in output.attentions)
            return output
        if isinstance(output, tuple):
            return (output[0][:, -new_tokens:],) + output[1:]
        raise TypeError(f"Unexpected output type {type(output).__name__} from the patched model.")


_FORWARD_SIGNATURES: dict[type, inspect.Signature] = {}  # per model class: read once, bound per forward


class CacheRecord:
    """Forward hooks that refuse a KV cache the current patch did not fill, for patches without
    other cache hooks (static methods): its states carry the frequencies they were written with, so
    a cache filled before patching or under another patch would continue with wrong ones.

    (:class:`PrefixRecompute` and the attention-level methods' hooks keep this record themselves.)
    """

    def __init__(self, caller: nn.Module, method: str):
        self.filled = FilledCaches(method)
        # Compiled forwards ran under this patch: a cache without a record may be one they filled.
        self.compiled_writes = False
        self.handles = [
            caller.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            caller.register_forward_hook(self._after_forward, with_kwargs=True),
        ]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _cache(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[str | None, Any]:
        name, cache = compat.cache_argument(kwargs)  # as generate passes it: no binding on the decode path
        if cache is None and len(args) > 1:  # given by position
            signature = _FORWARD_SIGNATURES.get(type(module))
            if signature is None:  # kept per class, not here: a static patch pickles with the model
                signature = _FORWARD_SIGNATURES[type(module)] = inspect.signature(module.forward)
            try:
                name, cache = compat.cache_argument(compat.call_arguments(signature, args, kwargs))
            except TypeError:  # the forward itself will say what is wrong with its arguments
                return None, None
        return name, (cache if compat.is_cache(cache) else None)

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.compiler.is_compiling():  # static patches compile with fullgraph=True: no record there,
            self.compiled_writes = True  # only this flag (an attribute set is replayed by the compiled code)
            return
        name, cache = self._cache(module, args, kwargs)
        # A cache this patch wrote to continues with its own frequencies, whatever it holds now (crop,
        # reset, compiled steps): only a cache new to this patch is counted (one device sync, not one
        # per decode step), and refused if it is not empty.
        if cache is not None and cache not in self.filled and not self.compiled_writes:
            self.filled.check(cache, name)

    def _after_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        _, cache = self._cache(module, args, kwargs)
        cache = cache if cache is not None else compat.output_cache(output)  # one the model made
        if compat.is_cache(cache) and cache not in self.filled:
            self.filled.record(cache, None)


def _padding_of_new_tokens(mask: Any, past: int, new_tokens: int, device: torch.device) -> torch.Tensor:
    """1/0 per new token: is it a real token (1) or padding (0)?

    Read from a 2-D padding mask over the whole sequence, or from the diagonal of a 4-D mask
    (a token always sees itself unless it is padding; `generate` passes 4-D masks for static
    caches). No mask means no padding.
    """
    if not isinstance(mask, torch.Tensor):
        return torch.ones(1, new_tokens, dtype=torch.long, device=device)
    if mask.dim() == 2:
        return mask[:, -new_tokens:].long()
    if mask.dim() == 4:
        rows = torch.arange(new_tokens, device=mask.device)
        # A sliding-window cache keeps only its last W slots: once it is full, the new tokens are
        # its last columns, not columns past .. past + new_tokens.
        start = min(past, mask.shape[-1] - new_tokens)
        diagonal = mask[:, 0, rows, start + rows]
        visible = diagonal if diagonal.dtype == torch.bool else diagonal == 0
        return visible.long()
    raise ValueError(f"Unsupported attention_mask of shape {tuple(mask.shape)}; pass a 2-D (batch, seq) mask.")


# -- the planned length of generate -----------------------------------------------------------

# What `generate` was on the instance before wrapping (None: the class's own).
_WRAPPED_ATTRIBUTE = "_hf_rope_ext_generate_before"


def _recomputes_in(model: nn.Module) -> list[PrefixRecompute]:
    guards = [getattr(module, "cache_guard", None) for module in model.modules() if isinstance(module, ExtendedRotaryEmbedding)]
    return [guard for guard in guards if isinstance(guard, PrefixRecompute)]  # static patches' CacheRecord plans nothing


def _generate_with_plan(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``generate`` that first announces its planned length to the model's prefix recomputes."""
    before = self.__dict__.get(_WRAPPED_ATTRIBUTE)
    generate = type(self).generate.__get__(self) if before is None else before
    plan = compat.planned_generation_length(self, args, kwargs)
    recomputes = _recomputes_in(self)
    with contextlib.ExitStack() as stack:
        # The whole call holds the model for this thread (see PrefixRecompute.planning): the plan
        # and the raised max_position_embeddings below last from the first forward to the last.
        for recompute in recomputes:
            stack.enter_context(recompute.planning(plan))
        stack.enter_context(_extended_context_in_config(self, recomputes))
        return generate(*args, **kwargs)


@contextlib.contextmanager
def _extended_context_in_config(model: nn.Module, recomputes: list[PrefixRecompute]) -> Iterator[None]:
    """``config.max_position_embeddings`` is the patch's extended context for one ``generate`` call.

    Length-dependent patches keep it at the original context (see :mod:`hf_rope_ext.config_io`),
    but ``generate`` reads it as the model's maximum length: a call that sets no length is capped
    there (refused outright when the prompt is longer) and tokens past it are warned about. During
    the call it holds what a static method's patch writes, and the original value comes back after.
    """
    config = getattr(model, "config", None)
    current = getattr(config, "max_position_embeddings", None)
    specs = [recompute.rotary.spec for recompute in recomputes if recompute.rotary.spec is not None]
    extended = max((spec.extended_context for spec in specs), default=None)
    if extended is None or not isinstance(current, int) or current >= extended:
        yield
        return
    config.max_position_embeddings = extended
    for recompute in recomputes:  # a copy of the model made meanwhile gets it back (PrefixRecompute.__deepcopy__)
        recompute.context_before_generate = (config, current)
    try:
        yield
    finally:
        config.max_position_embeddings = current
        for recompute in recomputes:
            recompute.context_before_generate = None


def _wrap_generate(model: nn.Module) -> list[nn.Module]:
    """Give each generation model in ``model`` an instance-level ``generate`` that plans.

    A bound method (not a closure) so that ``copy.deepcopy(model)`` binds it to the copy.
    The class is untouched; :func:`_unwrap_generate` restores the instance.
    """
    wrapped = []
    for module in model.modules():
        if not isinstance(module, GenerationMixin) or _WRAPPED_ATTRIBUTE in module.__dict__:
            continue
        module.__dict__[_WRAPPED_ATTRIBUTE] = module.__dict__.get("generate")
        module.__dict__["generate"] = types.MethodType(_generate_with_plan, module)
        wrapped.append(module)
    return wrapped


def _unwrap_generate(module: nn.Module) -> None:
    before = module.__dict__.pop(_WRAPPED_ATTRIBUTE, None)
    module.__dict__.pop("generate", None)
    if before is not None:
        module.__dict__["generate"] = before


@contextlib.contextmanager
def planned_length(model: nn.Module, length: int) -> Iterator[nn.Module]:
    """Forwards of ``model`` inside use the frequencies of at least ``length`` tokens.

    ``generate`` does this by itself (prompt plus ``max_new_tokens``). Use it for a decode loop
    of your own, so that the cache is filled once with the frequencies of the final length and
    never recomputed, or to reproduce a generation's logits with one full forward::

        with planned_length(model, prompt_length + new_tokens):
            logits = model(sequence).logits

    Static methods have no length-dependent frequencies: the context changes nothing for them.
    For length-dependent ones the plan is the model's, so the block holds the model for this
    thread: another thread's forward or ``generate`` of it meanwhile is refused (``RuntimeError``).
    """
    try:
        length = check_length(length, "planned_length's length")  # numpy and whole float lengths too
    except TypeError as error:
        raise ValueError(str(error)) from None
    check_context(length, "planned_length's length")
    if not any(isinstance(module, ExtendedRotaryEmbedding) for module in model.modules()):
        raise ValueError(f"{type(model).__name__} is not patched by hf_rope_ext; planned_length applies to patched models.")
    with contextlib.ExitStack() as stack:
        for recompute in _recomputes_in(model):
            stack.enter_context(recompute.planning(length))
        yield model
