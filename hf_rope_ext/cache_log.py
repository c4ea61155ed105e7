"""What each KV cache was filled with, so that its states can be recomputed, and which patch filled it.

:class:`CacheLogs` maps caches (weakly: a dropped cache frees its log) to an :class:`InputLog`
(or, in :class:`FilledCaches`, to a :class:`CacheEnd`) and keeps each log in step with its
cache's batch operations: ``reorder_cache`` (beam search), ``batch_select_indices`` and
``batch_repeat_interleave``, through instance-level wrappers that hold only weak references,
and ``copy.deepcopy(cache)``, whose copy gets the same log. A ``crop`` is not wrapped: the
reader of a log cuts it to the length the cache reports.
"""

from __future__ import annotations

import copy
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class InputLog:
    """Everything written to one cache.

    ``segments`` holds the inputs in writing order, in runs of one kind: token ids
    ``(batch, n)`` or input embeddings ``(batch, n, hidden)``. Ids stay ids (one integer per
    token); embeddings that were passed are kept, as a recomputation cannot get them back any
    other way. A log is never changed in place, so copies of a cache can share one.
    """

    segments: tuple[torch.Tensor, ...]
    positions: torch.Tensor  # (batch or 1, n) position ids
    mask: torch.Tensor  # (batch or 1, n) 1 for real tokens, 0 for padding
    effective_length: int | None  # length whose frequencies the cached states carry (None: the original)

    @property
    def width(self) -> int:
        """How many tokens were written."""
        return self.positions.shape[1]

    @property
    def length(self) -> int:
        return int(self.positions.max()) + 1

    def extended(
        self, inputs: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, effective_length: int | None
    ) -> InputLog:
        """This log followed by the tokens of one more call."""
        batch = max(inputs.shape[0], *(segment.shape[0] for segment in self.segments))
        segments = [_expand_batch(segment, batch) for segment in self.segments]
        if segments[-1].dim() == inputs.dim():
            segments[-1] = _broadcast_cat(segments[-1], inputs)
        else:
            segments.append(_expand_batch(inputs, batch))
        return InputLog(
            tuple(segments), _broadcast_cat(self.positions, positions), _broadcast_cat(self.mask, mask), effective_length
        )

    def cropped(self, width: int) -> InputLog:
        """The first ``width`` tokens (``cache.crop`` removed the others from the end)."""
        segments, start = [], 0
        for segment in self.segments:
            if start < width:
                segments.append(segment[:, : width - start])
            start += segment.shape[1]
        return InputLog(tuple(segments), self.positions[:, :width], self.mask[:, :width], self.effective_length)

    def rows(self, select: Callable[[torch.Tensor], torch.Tensor]) -> InputLog:
        """The log after the cache's rows went through ``select`` (a batch operation)."""

        def follow(tensor: torch.Tensor) -> torch.Tensor:
            return tensor if tensor.shape[0] == 1 else select(tensor)  # a batch of 1 broadcasts over any batch

        segments = tuple(select(segment) for segment in self.segments)
        return InputLog(segments, follow(self.positions), follow(self.mask), self.effective_length)


def _expand_batch(tensor: torch.Tensor, batch: int) -> torch.Tensor:
    return tensor if tensor.shape[0] == batch else tensor.expand(batch, *tensor.shape[1:])


def _broadcast_cat(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Concatenate along the sequence axis; a batch of 1 broadcasts (position ids often do)."""
    batch = max(old.shape[0], new.shape[0])
    return torch.cat([_expand_batch(old, batch), _expand_batch(new, batch).to(old.device)], dim=1)


@dataclass(frozen=True)
class CacheEnd:
    """Where the last forward under one patch left a cache: the tokens it held, and the position of
    each row's last token (None: unknown, as after a ``crop``, or taken from the cache by the model)."""

    tokens: int
    last_positions: torch.Tensor | None  # (batch or 1,)

    def rows(self, select: Callable[[torch.Tensor], torch.Tensor]) -> CacheEnd:
        """The record after the cache's rows went through ``select`` (a batch operation)."""
        if self.last_positions is None or self.last_positions.shape[0] == 1:  # a batch of 1 broadcasts
            return self
        return CacheEnd(self.tokens, select(self.last_positions))


def foreign_cache_error(held: int, written: int, method: str | None, argument: str | None) -> ValueError:
    """The refusal of a cache whose states were not all written under the current patch."""
    patch = "patch" if method is None else f"'{method}' patch"
    return ValueError(
        f"The KV cache passed to the model holds {held} tokens, {held - written} of them not written under this "
        f"model's current {patch} (filled before patching, under another patch, outside the model, or before "
        "this patch was put back by a patched() block, a refused re-patch or check_configurations), so "
        f"their states carry other positions or frequencies; start from a fresh cache ({argument or 'cache'}=None) "
        "or run the whole sequence in one forward. (peft prefix tuning passes its virtual key/values as such a cache, "
        "which patched models do not support: use LoRA or prompt tuning.)"
    )


class CacheLogs:
    """The log (:class:`InputLog`, or another record with ``rows``) of each cache one owner filled,
    keyed weakly by the cache object."""

    def __init__(self) -> None:
        self._logs: weakref.WeakKeyDictionary[Any, InputLog] = weakref.WeakKeyDictionary()

    def __deepcopy__(self, memo: dict) -> CacheLogs:
        return CacheLogs()  # a copy of the model continues none of the original's caches

    def __len__(self) -> int:
        return len(self._logs)

    def __contains__(self, cache: Any) -> bool:
        return cache in self._logs

    def get(self, cache: Any) -> InputLog | None:
        return self._logs.get(cache)

    def set(self, cache: Any, log: InputLog) -> None:
        self._logs[cache] = log
        for name in _ROW_OPERATIONS:
            current = vars(cache).get(name)
            if isinstance(current, _RowOperation):
                current.logs.add(self)
            else:
                setattr(cache, name, _RowOperation(cache, name, [self], current))

    def discard(self, cache: Any) -> None:
        self._logs.pop(cache, None)

    def _follow_rows(self, cache: Any, select: Callable[[torch.Tensor], torch.Tensor]) -> None:
        log = self._logs.get(cache)
        if log is not None:
            self._logs[cache] = log.rows(select)

    def _share(self, cache: Any, duplicate: Any) -> None:
        log = self._logs.get(cache)
        if log is not None and duplicate not in self._logs:
            self._logs[duplicate] = log


class FilledCaches(CacheLogs):
    """The caches one patch filled and where it left each (:class:`CacheEnd`), so that a cache
    written before patching or under another patch is refused rather than continued with states
    that carry other positions or frequencies (a model's patch is replaced, never edited)."""

    def __init__(self, method: str | None = None) -> None:
        super().__init__()
        self.method = method

    def __deepcopy__(self, memo: dict) -> FilledCaches:
        return FilledCaches(self.method)  # a copy of the model continues none of the original's caches

    def __reduce__(self) -> tuple:
        return FilledCaches, (self.method,)  # nor does a pickled model (static patches pickle)

    def check(self, cache: Any, argument: str | None = None) -> CacheEnd | None:
        """Where this patch left ``cache`` (None: the cache is empty); ``ValueError`` if it holds
        tokens this patch did not write. ``argument``: the name the cache was passed under."""
        held = int(cache.get_seq_length())
        end = self.get(cache)
        if held == 0:  # new, or `reset` (generate reuses its static cache)
            self.discard(cache)
            return None
        if end is None or held > end.tokens:
            raise foreign_cache_error(held, 0 if end is None else end.tokens, self.method, argument)
        if held < end.tokens:  # `crop` removed tokens from the end (assisted decoding)
            end = CacheEnd(held, None)
            self.set(cache, end)
        return end

    def record(self, cache: Any, last_positions: torch.Tensor | None) -> None:
        """A forward under this patch wrote to ``cache``; ``last_positions``: each row's last position."""
        self.set(cache, CacheEnd(int(cache.get_seq_length()), last_positions))


# How each batch operation of a Cache moves its rows, applied to a log tensor.
_ROW_OPERATIONS: dict[str, Callable[..., torch.Tensor]] = {
    "reorder_cache": lambda tensor, beam_idx: tensor.index_select(0, beam_idx.to(tensor.device)),
    "batch_repeat_interleave": lambda tensor, repeats: tensor.repeat_interleave(repeats, dim=0),
    "batch_select_indices": lambda tensor, indices: tensor[
        indices.to(tensor.device) if isinstance(indices, torch.Tensor) else indices
    ],
}


def _same(value: Any) -> Any:
    return value


def _class_method(cache: Any, name: str) -> Any:
    """The method ``name`` of the cache's class, bound to the (unpickled) cache."""
    return types.MethodType(getattr(type(cache), name), cache)


class _RowOperation:
    """Stands in for one batch operation of one cache instance (the class is untouched): runs
    it, then moves the rows of the cache's logs the same way.

    Holds the cache and the logs weakly: it keeps neither the cache's log nor its owner alive.
    """

    def __init__(self, cache: Any, name: str, logs: list[CacheLogs], before: Any = None):
        self.name = name
        self.cache = weakref.ref(cache)
        self.logs: weakref.WeakSet[CacheLogs] = weakref.WeakSet(logs)
        self.before = before  # an instance-level override that was there first (None: the class's method)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cache = self.cache()
        if self.before is not None:
            result = self.before(*args, **kwargs)
        else:
            result = getattr(type(cache), self.name)(cache, *args, **kwargs)
        operation = _ROW_OPERATIONS[self.name]
        for logs in list(self.logs):
            logs._follow_rows(cache, lambda tensor: operation(tensor, *args, **kwargs))
        return result

    def __reduce__(self) -> tuple:
        # Pickling the cache (torch.save of a prefilled prompt): the logs belong to this process and
        # are not saved, so the loaded cache gets its own method back, as an unpatched model's has.
        if self.before is not None:
            return _same, (self.before,)
        return _class_method, (self.cache(), self.name)

    def __deepcopy__(self, memo: dict) -> Any:
        # `copy.deepcopy(cache)` (transformers' recipe to reuse a prefilled prompt): the copy is
        # created before its attributes are copied, so it is in `memo`; it gets the same logs.
        cache = self.cache()
        duplicate = memo.get(id(cache)) if cache is not None else None
        if duplicate is None:
            return self
        logs = list(self.logs)
        for owner_logs in logs:
            owner_logs._share(cache, duplicate)
        return _RowOperation(duplicate, self.name, logs, copy.deepcopy(self.before, memo))
