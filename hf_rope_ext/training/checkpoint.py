"""Resumable training checkpoints as safetensors + JSON (no pickle anywhere).

A checkpoint is a folder ``step-0000050/`` holding

* ``trainable.safetensors``: the trained parameters (LoRA matrices, trained embeddings/norms);
* ``optimizer.safetensors`` + ``optimizer.json``: the optimizer's per-parameter state tensors,
  keyed by parameter name, and its hyper-parameters;
* ``rng-rank<r>.safetensors`` + ``rng-rank<r>.json``: every process's random number
  generator states (torch CPU and CUDA, Python, NumPy), so dropout continues identically;
* ``trainer_state.json``: the step, the data position, the LR scheduler, counters, and what
  the run was configured with. It is written last.

Writes go through :func:`hf_rope_ext.files.atomic_directory` (a hidden folder renamed into place
only when complete), so a run killed while saving leaves the previous checkpoints intact and
never a partial one under a checkpoint name. Only the newest ``keep_last`` checkpoints are kept.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..files import atomic_directory, atomic_write_json

logger = logging.getLogger(__name__)

__all__ = [
    "atomic_write_json",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "prune_checkpoints",
    "read_trainer_state",
    "save_checkpoint",
]

STATE_FILE = "trainer_state.json"
# Hidden folder beside the checkpoints where every process leaves its RNG state while saving.
RNG_STAGING_SUFFIX = ".staging-rng"
# Part of the hidden name an old checkpoint is renamed to before it is deleted.
REMOVING_MARKER = ".removing-"
_NAME = re.compile(r"^step-(\d+)$")


def checkpoint_name(step: int) -> str:
    return f"step-{step:07d}"


def list_checkpoints(folder: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``folder`` as ``(step, path)``, oldest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        match = _NAME.match(path.name)
        if match and path.is_dir() and (path / STATE_FILE).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(folder: str | Path) -> Path | None:
    checkpoints = list_checkpoints(folder)
    return checkpoints[-1][1] if checkpoints else None


# -- pieces ----------------------------------------------------------------------------------


def _contiguous_cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu").contiguous().clone()


def optimizer_state_tensors(optimizer: torch.optim.Optimizer, names: list[str]) -> tuple[dict[str, torch.Tensor], dict]:
    """Split ``optimizer.state_dict()`` into tensors keyed ``"<param name>::<state key>"`` and JSON.

    ``names[i]`` is the name of the optimizer's i-th parameter (over all param groups in order).
    """
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, entry in state["state"].items():
        name = names[index]
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{name}::{key}"] = _contiguous_cpu(value)
            else:
                scalars.setdefault(name, {})[key] = value
    groups = []
    for group in state["param_groups"]:
        groups.append({key: (list(value) if isinstance(value, tuple) else value) for key, value in group.items()})
    return tensors, {"param_names": names, "param_groups": groups, "scalars": scalars}


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, names: list[str], tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]
) -> None:
    """Inverse of :func:`optimizer_state_tensors`; refuses a different set of parameters."""
    if list(meta["param_names"]) != list(names):
        saved, now = set(meta["param_names"]), set(names)
        raise ValueError(
            "The checkpoint's optimizer state is for different trainable parameters "
            f"(only in checkpoint: {sorted(saved - now)[:5]}, only in this run: {sorted(now - saved)[:5]}). "
            "Resume with the same LoRA settings."
        )
    index_of = {name: index for index, name in enumerate(names)}
    state: dict[int, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        name, _, field = key.rpartition("::")
        state.setdefault(index_of[name], {})[field] = tensor
    for name, values in meta.get("scalars", {}).items():
        state.setdefault(index_of[name], {}).update(values)
    groups = []
    for group in meta["param_groups"]:
        groups.append({key: (tuple(value) if key == "betas" else value) for key, value in group.items()})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This process's RNG states: tensors (torch CPU/CUDA) and JSON (Python, NumPy)."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for index, value in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{index}"] = value
    version, internal, gauss = random.getstate()
    meta: dict[str, Any] = {"python": [version, list(internal), gauss]}
    try:
        import numpy as np

        kind, keys, position, has_gauss, cached = np.random.get_state()
        meta["numpy"] = [kind, keys.tolist(), int(position), int(has_gauss), float(cached)]
    except ImportError:  # numpy is optional
        pass
    return tensors, meta


def set_rng_state(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = [tensors[key] for key in sorted(k for k in tensors if k.startswith("torch_cuda_"))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in meta:
        import numpy as np

        kind, keys, position, has_gauss, cached = meta["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached))


# -- whole checkpoints -------------------------------------------------------------------------


def save_checkpoint(
    folder: str | Path,
    step: int,
    *,
    trainable: Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    param_names: list[str],
    trainer_state: Mapping[str, Any],
    keep_last: int,
    rank: int = 0,
    world_size: int = 1,
    barrier: Callable[[], None] = lambda: None,
) -> Path:
    """Write a checkpoint for ``step`` atomically (see the module docstring).

    Called by every process of a run: each writes its RNG state to a hidden folder shared by
    the processes, then the main process (rank 0) writes the checkpoint through
    :func:`hf_rope_ext.files.atomic_directory`, moves the RNG states in, and prunes old checkpoints.
    """
    folder = Path(folder)
    final = folder / checkpoint_name(step)
    # The staging folder of atomic_directory has a random name only rank 0 knows: the other
    # processes put their RNG states in this fixed-name folder, and rank 0 moves them in.
    rng_folder = folder / f".{checkpoint_name(step)}{RNG_STAGING_SUFFIX}"
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(rng_folder, ignore_errors=True)  # left by a run killed while saving this step
        rng_folder.mkdir()
    barrier()
    rng_tensors, rng_meta = rng_state()
    save_file(rng_tensors, str(rng_folder / f"rng-rank{rank}.safetensors"))
    atomic_write_json(rng_folder / f"rng-rank{rank}.json", rng_meta)
    barrier()
    if rank == 0:
        try:
            # A checkpoint of the same step from an earlier attempt is replaced whole.
            with atomic_directory(final) as staging:
                save_file({name: _contiguous_cpu(tensor) for name, tensor in trainable.items()}, str(staging / "trainable.safetensors"))
                optimizer_tensors, optimizer_meta = optimizer_state_tensors(optimizer, param_names)
                save_file(optimizer_tensors, str(staging / "optimizer.safetensors"))
                atomic_write_json(staging / "optimizer.json", optimizer_meta)
                for path in rng_folder.iterdir():
                    os.replace(path, staging / path.name)
                atomic_write_json(staging / STATE_FILE, {**trainer_state, "step": step, "world_size": world_size})
        finally:
            shutil.rmtree(rng_folder, ignore_errors=True)
        logger.info("Saved checkpoint %s.", final)
        prune_checkpoints(folder, keep_last)
    barrier()
    return final


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint folder. It is renamed to a hidden name first, so that a process killed
    during the deletion leaves no half-deleted folder under a checkpoint name (such leftovers are
    removed by :func:`prune_checkpoints` and at the next start)."""
    hidden = path.with_name(f".{path.name}{REMOVING_MARKER}{uuid.uuid4().hex[:8]}")
    try:
        os.replace(path, hidden)
    except OSError:  # (a file system that cannot rename it): delete in place
        hidden = path
    shutil.rmtree(hidden, ignore_errors=True)


def prune_checkpoints(folder: str | Path, keep_last: int) -> None:
    """Keep the newest ``keep_last`` complete checkpoints; also remove what an interrupted
    removal left: hidden ``.removing-`` folders, and ``step-N`` folders without trainer_state.json
    older than the newest complete checkpoint (half-deleted in place by earlier versions)."""
    folder = Path(folder)
    complete = list_checkpoints(folder)
    if not complete or keep_last < 1:
        return
    for _, old in complete[:-keep_last]:
        remove_checkpoint(old)
        logger.info("Removed old checkpoint %s.", old)
    newest = complete[-1][0]
    for entry in folder.iterdir():
        match = _NAME.match(entry.name)
        if entry.name.startswith(".") and REMOVING_MARKER in entry.name:
            shutil.rmtree(entry, ignore_errors=True)
        elif match and entry.is_dir() and int(match.group(1)) < newest and not (entry / STATE_FILE).is_file():
            remove_checkpoint(entry)
            logger.info("Removed %s, a checkpoint left half-deleted.", entry)


# What a resumed run reads from trainer_state.json and optimizer.json.
REQUIRED_STATE_KEYS = ("step", "tokens_seen", "train_time_s", "losses", "scheduler", "run", "data")
REQUIRED_OPTIMIZER_KEYS = ("param_names", "param_groups")


def damaged(path: Path, file: str, problem: str) -> ValueError:
    """The one error for a checkpoint that cannot be read (a run killed while writing, a full disk)."""
    return ValueError(
        f"Checkpoint {path} is damaged: {file} {problem}. Delete the folder {path} to resume from the previous "
        "checkpoint, or start afresh in a new --output-dir."
    )


def _read_json(path: Path, file: str, required: tuple[str, ...] = ()) -> dict[str, Any]:
    try:
        record = json.loads((path / file).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise damaged(path, file, "is missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise damaged(path, file, f"is not valid JSON ({error})") from None
    if not isinstance(record, dict):
        raise damaged(path, file, "is not a JSON object")
    missing = [key for key in required if key not in record]
    if missing:
        raise damaged(path, file, f"lacks {missing}")
    return record


def _read_tensors(path: Path, file: str) -> dict[str, torch.Tensor]:
    if not (path / file).is_file():
        raise damaged(path, file, "is missing")
    try:
        return load_file(str(path / file))
    except SafetensorError as error:
        raise damaged(path, file, f"cannot be read ({error})") from None


def read_trainer_state(path: str | Path) -> dict[str, Any]:
    """``trainer_state.json`` of a checkpoint, with the keys a resume needs (``ValueError`` otherwise)."""
    return _read_json(Path(path), STATE_FILE, REQUIRED_STATE_KEYS)


def load_checkpoint(
    path: str | Path,
    *,
    optimizer: torch.optim.Optimizer,
    param_names: list[str],
    rank: int = 0,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Load a checkpoint: sets the optimizer state and this process's RNG states.

    Returns ``(trainable tensors, trainer state)``; the caller copies the tensors into the model.
    A file that is missing, cut off or lacks what a resume reads raises one ``ValueError``
    naming the checkpoint, the file and the fix.
    """
    path = Path(path)
    trainer_state = read_trainer_state(path)
    trainable = _read_tensors(path, "trainable.safetensors")
    missing = [name for name in param_names if name not in trainable]
    if missing:
        raise damaged(path, "trainable.safetensors", f"lacks {len(missing)} trained parameters ({missing[0]}, ...)")
    optimizer_meta = _read_json(path, "optimizer.json", REQUIRED_OPTIMIZER_KEYS)
    load_optimizer_state(optimizer, param_names, _read_tensors(path, "optimizer.safetensors"), optimizer_meta)
    rng_file = path / f"rng-rank{rank}.safetensors"
    if rng_file.is_file():
        set_rng_state(_read_tensors(path, rng_file.name), _read_json(path, f"rng-rank{rank}.json", ("python",)))
    else:
        logger.warning(
            "%s has no RNG state for process %d (saved with %s processes): dropout masks will differ "
            "from an uninterrupted run.",
            path,
            rank,
            trainer_state.get("world_size"),
        )
    return trainable, trainer_state
