"""Training windows cut from long documents, with optional PoSE position ids.

Two ways to train a model for a target context ``L = s * L0`` (``L0`` the original context):

* **Full-length windows**: each example is ``window`` consecutive tokens of one document
  (default ``window = L``) with position ids ``0 .. window - 1``.
* **PoSE** (Zhu et al., "PoSE: Efficient Context Window Extension of LLMs via Positional
  Skip-wise Training", ICLR 2024, arXiv 2309.10400): each example holds only ``window <= L0``
  tokens, but its position ids are spread over ``[0, L)``, so a 4x extension trains at the
  memory cost of the original context. The scheme is the one of the paper's released code
  (two chunks):

  - the example's source is a span ``x`` of up to ``L`` tokens of one document
    (``n = len(x) >= window``);
  - first chunk length ``l1 ~ U{1, ..., floor((window + 1) / 2)}``;
  - content skip ``v ~ U{0, ..., n - window}``; the tokens are
    ``x[0 : l1] ++ x[l1 + v : window + v]``;
  - position skip ``u ~ U{0, ..., L - window}``; the position ids are
    ``0 .. l1 - 1`` followed by ``l1 + u .. window - 1 + u``, so the last one is at most ``L - 1``.

  Content and position skips are sampled independently, as in the paper's code. One
  difference: when ``v > 0`` the first token of the second chunk does not follow the last token
  of the first chunk in the text, so its label is masked (-100) instead of asking the model to
  predict it.

Every document is cut at multiples of ``window``: the example at ``start`` uses
``doc[start : start + window]`` (full-length) or the span ``doc[start : start + L]`` clipped to
the document's end (PoSE). The tail of a document shorter than a window is not used (logged).

Examples are addressed by a global sample counter ``k``: ``k // len(windows)`` is the epoch,
whose order is a permutation seeded by ``seed + epoch``, and PoSE draws come from a generator
seeded by ``(seed, k)``. So the data of every step is fixed by the seed and the step number:
a resumed run sees exactly what an uninterrupted run would, whatever the number of processes.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

__all__ = ["PackedWindows", "PoseDraw", "draw_pose", "pose_position_ids"]

IGNORE_INDEX = -100  # the label transformers' loss skips


@dataclass(frozen=True)
class PoseDraw:
    """One PoSE draw: first chunk length ``l1``, content skip ``v`` and position skip ``u``."""

    first_chunk: int
    content_skip: int
    position_skip: int


def draw_pose(window: int, span: int, target_length: int, generator: torch.Generator) -> PoseDraw:
    """Sample ``(l1, v, u)`` as in the module docstring (all three uniform over their ranges)."""
    if not 2 <= window <= span:
        raise ValueError(f"PoSE needs 2 <= window <= span, got window={window}, span={span}.")
    if target_length < window:
        raise ValueError(f"PoSE target_length={target_length} is shorter than the window ({window}).")

    def uniform(low: int, high: int) -> int:  # inclusive
        return int(torch.randint(low, high + 1, (1,), generator=generator))

    return PoseDraw(
        first_chunk=uniform(1, (window + 1) // 2),
        content_skip=uniform(0, span - window),
        position_skip=uniform(0, target_length - window),
    )


def pose_position_ids(window: int, first_chunk: int, position_skip: int) -> torch.Tensor:
    """``[0, ..., l1 - 1, l1 + u, ..., window - 1 + u]`` as a 1-D long tensor."""
    positions = torch.arange(window, dtype=torch.long)
    positions[first_chunk:] += position_skip
    return positions


@dataclass(frozen=True)
class _Source:
    document: int
    start: int
    span: int


def _sample_seed(seed: int, sample_index: int) -> int:
    digest = hashlib.sha256(f"pose:{seed}:{sample_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class PackedWindows:
    """Fixed-size training examples cut from tokenized documents (see the module docstring).

    Args:
        documents: 1-D token id tensors, one per document.
        window: tokens per example.
        target_length: with ``pose=True``, the context ``L`` the position ids are spread over.
        pose: use PoSE position ids (``window`` must then be at most ``target_length``).
        names: a name per document, for error messages.
        skip_short_documents: drop documents shorter than a window (logged) instead of raising.
        seed: fixes the order of examples and the PoSE draws.
        shuffle: visit the windows in a seeded random order each epoch (else in order).
    """

    def __init__(
        self,
        documents: Sequence[torch.Tensor],
        window: int,
        *,
        target_length: int | None = None,
        pose: bool = False,
        names: Sequence[str] | None = None,
        skip_short_documents: bool = False,
        seed: int = 0,
        shuffle: bool = True,
    ):
        if isinstance(window, bool) or not isinstance(window, int) or window < 2:
            raise ValueError(f"window must be an integer number of tokens >= 2, got {window!r}.")
        if pose:
            if target_length is None:
                raise ValueError("PoSE needs target_length (the context the position ids are spread over).")
            if target_length <= window:
                raise ValueError(
                    f"PoSE window ({window}) must be shorter than the target length ({target_length}); "
                    "otherwise train on full-length windows without PoSE."
                )
        if not documents:
            raise ValueError("No documents to train on: give at least one text file or dataset with text.")
        names = list(names) if names is not None else [f"document {i}" for i in range(len(documents))]
        if len(names) != len(documents):
            raise ValueError(f"{len(names)} names for {len(documents)} documents.")

        self.documents = [torch.as_tensor(doc, dtype=torch.long).reshape(-1) for doc in documents]
        self.window = window
        self.pose = pose
        self.target_length = target_length if pose else window
        self.names = names
        self.seed = seed
        self.shuffle = shuffle

        short = [(name, len(doc)) for name, doc in zip(names, self.documents) if len(doc) < window]
        if short:
            listing = ", ".join(f"{name} ({length} tokens)" for name, length in short[:5])
            more = f" and {len(short) - 5} more" if len(short) > 5 else ""
            if not skip_short_documents:
                raise ValueError(
                    f"{len(short)} document(s) are shorter than one training window of {window} tokens: "
                    f"{listing}{more}. Use longer documents, a smaller window, or skip short documents "
                    "(skip_short_documents=True / --skip-short-documents)."
                )
            logger.warning("Skipping %d document(s) shorter than a window of %d tokens: %s%s.", len(short), window, listing, more)

        self._sources: list[_Source] = []
        unused = 0
        for index, doc in enumerate(self.documents):
            count = len(doc) // window
            for start in range(0, count * window, window):
                span = min(self.target_length, len(doc) - start) if pose else window
                self._sources.append(_Source(index, start, span))
            unused += len(doc) - count * window
        if not self._sources:
            raise ValueError(f"No training window of {window} tokens could be cut from the documents.")
        total = sum(len(doc) for doc in self.documents)
        logger.info(
            "%d training windows of %d tokens from %d document(s) (%d tokens; %d tokens in document tails unused)%s.",
            len(self._sources),
            window,
            len(self.documents),
            total,
            unused,
            f", PoSE positions over [0, {self.target_length})" if pose else "",
        )
        self._order_cache: tuple[int, torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self._sources)

    @property
    def num_tokens(self) -> int:
        """Tokens in all documents."""
        return sum(len(doc) for doc in self.documents)

    def fingerprint(self) -> dict:
        """What a checkpoint records to refuse resuming on different data."""
        digest = hashlib.sha256()
        for doc in self.documents:
            digest.update(doc.numpy().tobytes())
        return {
            "windows": len(self),
            "window": self.window,
            "pose": self.pose,
            "target_length": self.target_length,
            "shuffle": self.shuffle,
            "tokens_sha256": digest.hexdigest(),
        }

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self._order_cache is None or self._order_cache[0] != epoch:
            if self.shuffle:
                order = torch.randperm(len(self), generator=torch.Generator().manual_seed(self.seed + epoch))
            else:
                order = torch.arange(len(self))
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def window_index(self, sample_index: int) -> int:
        """Which window the ``sample_index``-th example of the run (counting over epochs) uses."""
        epoch, within = divmod(sample_index, len(self))
        return int(self._epoch_order(epoch)[within])

    def example(self, sample_index: int) -> dict[str, torch.Tensor]:
        """``{"input_ids", "position_ids", "labels"}`` (1-D, ``window`` long) of one example."""
        source = self._sources[self.window_index(sample_index)]
        doc = self.documents[source.document]
        span = doc[source.start : source.start + source.span]
        if not self.pose:
            input_ids = span.clone()
            return {"input_ids": input_ids, "position_ids": torch.arange(self.window), "labels": input_ids.clone()}
        generator = torch.Generator().manual_seed(_sample_seed(self.seed, sample_index))
        draw = draw_pose(self.window, len(span), self.target_length, generator)
        l1, v = draw.first_chunk, draw.content_skip
        input_ids = torch.cat((span[:l1], span[l1 + v : self.window + v]))
        labels = input_ids.clone()
        if v > 0:  # not the token that follows the first chunk in the text
            labels[l1] = IGNORE_INDEX
        position_ids = pose_position_ids(self.window, l1, draw.position_skip)
        return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}

    def batch(self, sample_indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """Examples stacked into ``(batch, window)`` tensors, plus an all-ones ``attention_mask``.

        The explicit mask matters for PoSE: given position ids with a jump and no mask,
        transformers (5.x) treats the jump as the start of a new packed sequence and stops the
        second chunk from attending to the first.
        """
        examples = [self.example(index) for index in sample_indices]
        batch = {key: torch.stack([example[key] for example in examples]) for key in examples[0]}
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        return batch
