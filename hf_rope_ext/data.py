"""Long documents as token ids: text files (Project Gutenberg books, PG-19) or a datasets dataset."""

from __future__ import annotations

import itertools
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_GUTENBERG_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG EBOOK.*?\*\*\*\s*$", re.M | re.I)
_GUTENBERG_END = re.compile(r"^\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG EBOOK", re.M | re.I)


def strip_gutenberg(text: str) -> str:
    """The book without Project Gutenberg's header and licence, if they are there."""
    start = _GUTENBERG_START.search(text)
    end = _GUTENBERG_END.search(text)
    begin = start.end() if start else 0
    finish = end.start() if end and end.start() > begin else len(text)
    return text[begin:finish].strip()


# Share of bytes that may fail to decode as UTF-8 (a stray Latin-1 character) before a file is
# refused as not UTF-8 text at all.
MAX_UNDECODABLE_FRACTION = 0.001


def read_text(path: str | Path, strip_header: bool = True) -> str:
    """Read a UTF-8 text file; raises a clear error if it is missing, empty or not UTF-8 text.

    Binary files (with NUL bytes) and files of which more than :data:`MAX_UNDECODABLE_FRACTION`
    of the bytes are not UTF-8 (another encoding) are refused; a few undecodable bytes are
    replaced by U+FFFD with a warning that gives their count.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Text file not found: {path}.")
    data = path.read_bytes()
    if b"\x00" in data:
        raise ValueError(f"{path} is a binary file (it holds NUL bytes), not UTF-8 text.")
    # surrogateescape maps each undecodable byte to one lone surrogate: count, then replace them.
    text = data.decode("utf-8", errors="surrogateescape")
    undecodable = sum(1 for char in text if "\udc80" <= char <= "\udcff")
    if undecodable:
        if undecodable > MAX_UNDECODABLE_FRACTION * len(data):
            raise ValueError(
                f"{path}: {undecodable} of its {len(data)} bytes are not valid UTF-8, so it is not UTF-8 text (another "
                "encoding, or a binary file). Convert it first, e.g. iconv -f latin1 -t utf-8."
            )
        logger.warning("%s: %d byte(s) are not valid UTF-8 and were replaced by U+FFFD.", path, undecodable)
        text = "".join("\ufffd" if "\udc80" <= char <= "\udcff" else char for char in text)
    if strip_header:
        text = strip_gutenberg(text)
    if not text.strip():
        raise ValueError(f"{path} contains no text.")
    return text


def tokenize(tokenizer, text: str, add_bos: bool = True) -> torch.Tensor:
    """Token ids of a whole document (1-D), optionally starting with the BOS token."""
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    bos = getattr(tokenizer, "bos_token_id", None)
    if add_bos and bos is not None:
        ids = [bos] + ids
    return torch.tensor(ids, dtype=torch.long)


def iter_dataset_texts(name: str, split: str = "test", text_field: str = "text", config: str | None = None,
                       limit: int | None = None) -> Iterator[str]:
    """Texts of a ``datasets`` dataset (e.g. ``emozilla/pg19-test``), streamed; needs Hub access."""
    try:
        import datasets
    except ImportError as error:
        raise ImportError("Reading a dataset needs the datasets package: pip install datasets") from error
    try:
        dataset = datasets.load_dataset(name, config, split=split, streaming=True)
        rows = iter(dataset)
        first = next(rows, None)  # streaming datasets connect on the first row
    except Exception as error:  # offline (ConnectionError), unknown name, wrong split or config, ...
        message = " ".join(str(error).split()).rstrip(".")
        raise OSError(
            f"Dataset {name!r} (split {split!r}) could not be read: {type(error).__name__}: {message}. Datasets are "
            "streamed from the Hugging Face Hub, which needs a network connection; pass local files with "
            "--text-files instead."
        ) from error
    if first is None:
        return
    for index, row in enumerate(itertools.chain([first], rows)):
        if limit is not None and index >= limit:
            break
        if text_field not in row:
            raise KeyError(f"Dataset {name} has no field {text_field!r}; fields: {sorted(row)}. Use --text-field.")
        yield row[text_field]
