"""One fused GPU kernel (Triton) for attention whose keys fall into two position regimes by distance.

Self-Extend (Jin et al., ICML 2024, arXiv 2401.01325) reads each key in one of two ways: keys
within ``W`` positions of the query keep their true positions (neighbour regime), farther keys
use remapped ones (grouped, or YaRN's by-parts split: see
:class:`hf_rope_ext.attention.SelfExtendRemap`). With queries and keys rotated once for each
regime (``q_near, k_near`` and ``q_far, k_far``), the logit of the pair at distance
``d = P_q - P_k`` is

    s(i, j) = scale * q_near[i] . k_near[j]    if 0 <= d < W
    s(i, j) = scale * q_far[i]  . k_far[j]     if W <= d <= max_distance
    (masked otherwise: keys after the query, or beyond a sliding window)

followed by one softmax over ``j``. :func:`two_regime_attention` computes this in one pass, as
FlashAttention-2 does (Dao 2023, arXiv 2307.08691): each program holds a block of queries,
walks the key blocks with an online softmax (running maximum and sum, float32) and never holds
a score matrix. Key blocks entirely in one regime take one matrix product; only the few blocks
that straddle ``d = W`` (about ``(BLOCK_M + BLOCK_N) / BLOCK_N`` per query block) take both.

The partial-softmax path of :mod:`hf_rope_ext.attention` computes the same thing with several
PyTorch kernel calls and a log-sum-exp merge; on a GPU this kernel replaces them for the chunks
it covers (consecutive positions, no padding mask, no gradient, bf16/fp16). It needs Triton,
which PyTorch's CUDA wheels install; without it the partial-softmax path runs.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import operator
import os

import torch

logger = logging.getLogger(__name__)

try:  # Triton ships with PyTorch's CUDA wheels; a CPU-only install has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None
    tl = None

__all__ = ["available", "two_regime_attention"]

_LOG2_E = 1.0 / math.log(2.0)
HEAD_DIMS = (16, 32, 64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def available() -> bool:
    """Whether Triton is importable (the kernel itself runs on CUDA, or anywhere under ``TRITON_INTERPRET=1``)."""
    return triton is not None


if triton is not None:

    @triton.jit
    def _online_softmax_step(scores, v, running_max, running_sum, acc, PRECISION: tl.constexpr):
        """Fold one key block (log2-scaled ``scores``, ``v``) into the running maximum, sum and
        output: FlashAttention-2's rescaling; a row with every score -inf so far stays at zero."""
        block_max = tl.maximum(running_max, tl.max(scores, 1))
        safe_max = tl.where(block_max == float("-inf"), 0.0, block_max)
        p = tl.math.exp2(scores - safe_max[:, None])
        alpha = tl.math.exp2(running_max - safe_max)
        running_sum = running_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return block_max, running_sum, acc

    @triton.jit
    def _two_regime_kernel(
        q_near_ptr, q_far_ptr, k_near_ptr, k_far_ptr, v_ptr, out_ptr, table_ptr,
        stride_qb, stride_qh, stride_qm,
        stride_fb, stride_fh, stride_fm,
        stride_kb, stride_kh, stride_kn,
        stride_gb, stride_gh, stride_gn,
        stride_vb, stride_vh, stride_vn,
        stride_ob, stride_oh, stride_om, stride_group,
        heads, heads_per_key, keys,
        first_distance, window, max_distance, scale_log2,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        WINDOWED: tl.constexpr, PRECISION: tl.constexpr,
    ):
        # Pair (row m, key column n) is at distance d = first_distance + m - n.
        # Each program's rows and far keys come from the block table: (first row, end of its
        # segment, far-key group). Blocks never straddle two groups' rows.
        block = tl.program_id(0)
        batch_head = tl.program_id(1)
        row_lo = tl.load(table_ptr + 3 * block)
        row_end = tl.load(table_ptr + 3 * block + 1)
        group = tl.load(table_ptr + 3 * block + 2).to(tl.int64)
        # Offsets of whole heads and of block starts in int64: (batch, head, row) offsets of a
        # long input (several heads of 128k tokens, a batch of them) pass 2**31 elements.
        batch = (batch_head // heads).to(tl.int64)
        head = (batch_head % heads).to(tl.int64)
        key_head = head // heads_per_key
        row_hi = tl.minimum(row_lo + BLOCK_M, row_end) - 1
        local_m = tl.arange(0, BLOCK_M)
        offs_m = row_lo + local_m
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        row_ok = offs_m < row_end
        first_row = row_lo.to(tl.int64)

        q_offsets = local_m[:, None] * stride_qm + offs_d[None, :]
        q_near_block = q_near_ptr + batch * stride_qb + head * stride_qh + first_row * stride_qm
        q_near = tl.load(q_near_block + q_offsets, mask=row_ok[:, None], other=0.0)
        f_offsets = local_m[:, None] * stride_fm + offs_d[None, :]
        q_far_block = q_far_ptr + batch * stride_fb + head * stride_fh + first_row * stride_fm
        q_far = tl.load(q_far_block + f_offsets, mask=row_ok[:, None], other=0.0)
        k_near_base = k_near_ptr + batch * stride_kb + key_head * stride_kh
        k_far_base = k_far_ptr + group * stride_group + batch * stride_gb + key_head * stride_gh
        v_base = v_ptr + batch * stride_vb + key_head * stride_vh

        running_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

        # Key range of this block: causal (d >= 0) and, with a window, d <= max_distance.
        key_end = tl.minimum(keys, first_distance + row_hi + 1)
        key_start = tl.maximum(first_distance + row_lo - max_distance, 0) // BLOCK_N * BLOCK_N
        # [key_start, far_end): whole blocks where every pair is far (d >= window from row_lo).
        far_end = tl.minimum(first_distance + row_lo - window + 1, key_end) // BLOCK_N * BLOCK_N
        far_end = tl.maximum(far_end, key_start)
        # [near_start, key_end): every pair near (d < window from row_hi); between: both regimes.
        near_start = (first_distance + row_hi - window + 1 + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        near_start = tl.minimum(tl.maximum(near_start, far_end), key_end)

        # Each loop walks its key blocks with pointers advanced one block per step (a block's
        # offsets stay small; the int64 start offsets above keep long inputs from wrapping).
        tile_k = offs_n[:, None] * stride_kn + offs_d[None, :]
        tile_g = offs_n[:, None] * stride_gn + offs_d[None, :]
        tile_v = offs_n[:, None] * stride_vn + offs_d[None, :]

        first = tl.cast(key_start, tl.int64)
        k_ptrs = k_far_base + first * stride_gn + tile_g
        v_ptrs = v_base + first * stride_vn + tile_v
        for start in range(key_start, far_end, BLOCK_N):
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
            scores = tl.dot(q_far, tl.trans(k), input_precision=PRECISION) * scale_log2
            if WINDOWED:
                distance = first_distance + offs_m[:, None] - (start + offs_n)[None, :]
                scores = tl.where(distance <= max_distance, scores, float("-inf"))
            running_max, running_sum, acc = _online_softmax_step(scores, v, running_max, running_sum, acc, PRECISION)
            k_ptrs += BLOCK_N * stride_gn
            v_ptrs += BLOCK_N * stride_vn

        first = tl.cast(far_end, tl.int64)
        k_near_ptrs = k_near_base + first * stride_kn + tile_k
        k_far_ptrs = k_far_base + first * stride_gn + tile_g
        v_ptrs = v_base + first * stride_vn + tile_v
        for start in range(far_end, near_start, BLOCK_N):
            cols = start + offs_n
            col_ok = cols < keys
            k_near = tl.load(k_near_ptrs, mask=col_ok[:, None], other=0.0)
            k_far = tl.load(k_far_ptrs, mask=col_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=col_ok[:, None], other=0.0)
            near_scores = tl.dot(q_near, tl.trans(k_near), input_precision=PRECISION)
            far_scores = tl.dot(q_far, tl.trans(k_far), input_precision=PRECISION)
            distance = first_distance + offs_m[:, None] - cols[None, :]
            scores = tl.where(distance < window, near_scores, far_scores) * scale_log2
            allowed = (distance >= 0) & (distance <= max_distance) & col_ok[None, :]
            scores = tl.where(allowed, scores, float("-inf"))
            running_max, running_sum, acc = _online_softmax_step(scores, v, running_max, running_sum, acc, PRECISION)
            k_near_ptrs += BLOCK_N * stride_kn
            k_far_ptrs += BLOCK_N * stride_gn
            v_ptrs += BLOCK_N * stride_vn

        first = tl.cast(near_start, tl.int64)
        k_ptrs = k_near_base + first * stride_kn + tile_k
        v_ptrs = v_base + first * stride_vn + tile_v
        for start in range(near_start, key_end, BLOCK_N):
            cols = start + offs_n
            col_ok = cols < keys
            k = tl.load(k_ptrs, mask=col_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=col_ok[:, None], other=0.0)
            scores = tl.dot(q_near, tl.trans(k), input_precision=PRECISION) * scale_log2
            distance = first_distance + offs_m[:, None] - cols[None, :]
            scores = tl.where((distance >= 0) & col_ok[None, :], scores, float("-inf"))
            running_max, running_sum, acc = _online_softmax_step(scores, v, running_max, running_sum, acc, PRECISION)
            k_ptrs += BLOCK_N * stride_kn
            v_ptrs += BLOCK_N * stride_vn

        # rows with no key (none here: a query always reads itself) would divide 0 by 0
        acc = acc / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
        o_offsets = local_m[:, None] * stride_om + offs_d[None, :]
        o_block = out_ptr + batch * stride_ob + head * stride_oh + first_row * stride_om
        tl.store(o_block + o_offsets, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _blocks(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for a head size (float32 tiles take twice the memory)."""
    wide = head_dim > 64 or dtype == torch.float32
    if head_dim > 128:
        return 64, 32, 4, 2
    return (128, 64, 8, 3) if wide else (128, 64, 4, 3)


def _whole(value, name: str, minimum: int) -> int:
    """``value`` as an int (numpy and torch integers too), or a one-line refusal."""
    try:
        number = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        number = None
    if number is None or number < minimum:
        raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r}.")
    return number


def _check_arguments(q_near, q_far, k_near, k_far, value, first_distance, window, max_distance, block_sizes,
                     far_rows) -> None:
    """One-line errors for what the kernel would otherwise fail on deep inside Triton (or get wrong)."""
    groups = _far_groups(k_far, far_rows, q_near)
    named = {"q_near": q_near, "q_far": q_far, "k_near": k_near, **groups, "value": value}
    for name, tensor in named.items():
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (batch, heads, tokens, head size), got "
                             f"{tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__}.")
        if tensor.dtype != q_near.dtype or tensor.device != q_near.device:
            raise ValueError(f"{name} is {tensor.dtype} on {tensor.device}, q_near {q_near.dtype} on {q_near.device}; "
                             "pass all of them in one dtype on one device.")
    if q_near.dtype not in DTYPES:
        raise ValueError(f"the kernel takes {', '.join(map(str, DTYPES))}, got {q_near.dtype}.")
    if q_near.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"the kernel runs on CUDA (or on the CPU under TRITON_INTERPRET=1), got tensors on {q_near.device}.")
    if torch.is_grad_enabled() and any(tensor.requires_grad for tensor in named.values()):
        raise ValueError("the kernel has no backward; call it under torch.no_grad() or use "
                         "hf_rope_ext.attention.remapped_attention, which is differentiable.")
    batch, heads, rows, head_dim = q_near.shape
    key_heads = k_near.shape[1]
    if (q_far.shape != q_near.shape or value.shape != k_near.shape
            or any(tensor.shape != k_near.shape for tensor in groups.values())):
        raise ValueError("q_near/q_far and k_near/k_far/value must have matching shapes.")
    if (head_dim not in HEAD_DIMS or key_heads == 0 or heads % key_heads or k_near.shape[0] != batch
            or k_near.shape[-1] != head_dim):
        raise ValueError(f"unsupported shapes: queries {tuple(q_near.shape)}, keys {tuple(k_near.shape)} "
                         f"(head size one of {HEAD_DIMS}, query heads a multiple of key heads).")
    _whole(first_distance, "first_distance", 0)
    _whole(window, "window", 1)
    if max_distance is not None:
        _whole(max_distance, "max_distance", window)
    if block_sizes is not None:
        if len(block_sizes) not in (2, 4) or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in block_sizes):
            raise ValueError(f"block_sizes must be (BLOCK_M, BLOCK_N) or (BLOCK_M, BLOCK_N, num_warps, num_stages), "
                             f"whole numbers, got {block_sizes!r}.")
        if any(b < 16 or b & (b - 1) for b in block_sizes[:2]):
            raise ValueError(f"BLOCK_M and BLOCK_N must be powers of two >= 16 (Triton's matrix products), got {block_sizes[:2]}.")


def _far_groups(k_far, far_rows, q_near) -> dict:
    """``{name: tensor}`` of the far keys, one per group; checks ``far_rows`` against them."""
    if far_rows is None:
        if isinstance(k_far, (list, tuple)):
            raise ValueError("k_far is a sequence of key tensors: give far_rows, the first query row each one serves.")
        return {"k_far": k_far}
    if not isinstance(k_far, (list, tuple)) or not k_far:
        raise ValueError("with far_rows, k_far must be a non-empty list of key tensors, one per entry of far_rows.")
    try:
        starts = [_whole(row, "each entry of far_rows", 0) for row in far_rows]
    except TypeError:
        raise ValueError(f"far_rows must be a sequence of whole numbers, got {far_rows!r}.") from None
    rows = q_near.shape[2] if isinstance(q_near, torch.Tensor) and q_near.dim() == 4 else None
    if len(starts) != len(k_far):
        raise ValueError(f"far_rows has {len(starts)} entries for {len(k_far)} far key tensors; give one row per tensor.")
    if starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])) or (rows is not None and starts[-1] >= max(rows, 1)):
        raise ValueError(f"far_rows must start at 0 and increase strictly, each below the {rows} query rows, got {far_rows!r}.")
    return {f"k_far[{index}]": tensor for index, tensor in enumerate(k_far)}


def _slices_of_one_tensor(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, int, list[int]] | None:
    """``(first, spacing, indices)`` when ``tensors`` are equal-shaped slices of one tensor whose
    starts lie whole multiples of ``spacing`` elements after the first one's (``stacked[i]`` for
    some ``i``): ``tensors[g]`` starts ``indices[g] * spacing`` elements after ``first``. None otherwise."""
    first = min(tensors, key=lambda t: t.storage_offset())
    storage = first.untyped_storage().data_ptr()
    if any(t.untyped_storage().data_ptr() != storage or t.shape != first.shape or t.stride() != first.stride()
           or t.dtype != first.dtype or t.stride(-1) != 1 for t in tensors):
        return None
    offsets = [t.storage_offset() - first.storage_offset() for t in tensors]
    spacing = math.gcd(*offsets)
    if spacing == 0:
        return None
    return first, spacing, [offset // spacing for offset in offsets]


@functools.lru_cache(maxsize=64)
def _block_table(far_rows: tuple[int, ...], groups: tuple[int, ...], rows: int, block_m: int,
                 device: torch.device) -> torch.Tensor:
    """The kernel's programs: ``(first row, end of its group's rows, group)`` for every block of
    ``block_m`` rows, cut where a group starts, so that no block mixes two groups' far keys
    (``groups[g]``: where the far keys of rows ``far_rows[g] ...`` lie, in steps of the group stride).

    Kept per arguments (the kernel only reads it): every layer of a forward launches the same
    blocks, and a copy to the GPU per layer would wait for the device each time."""
    ends = far_rows[1:] + (rows,)
    table = [(lo, end, group) for group, start, end in zip(groups, far_rows, ends) for lo in range(start, end, block_m)]
    return torch.tensor(table, dtype=torch.int32, device=device).reshape(-1)


def two_regime_attention(
    q_near: torch.Tensor,
    q_far: torch.Tensor,
    k_near: torch.Tensor,
    k_far: torch.Tensor | list[torch.Tensor],
    value: torch.Tensor,
    *,
    first_distance: int,
    window: int,
    scaling: float,
    max_distance: int | None = None,
    block_sizes: tuple[int, ...] | None = None,
    far_rows: list[int] | None = None,
) -> torch.Tensor:
    """Softmax attention with the near/far rule of the module docstring; returns ``(B, H, M, D)``.

    Args:
        q_near, q_far: (B, H, M, D) queries rotated for each regime (row ``m`` at position
            ``first_distance + m`` relative to key column 0).
        k_near, value: (B, Hkv, N, D), ``H`` a multiple of ``Hkv`` (grouped-query attention).
        k_far: (B, Hkv, N, D) keys of the far regime; or, with ``far_rows``, a list of them, one
            per group of queries (Self-Extend's group size changes with the query's position).
        first_distance: ``P_q(row 0) - P_k(column 0)``: positions are consecutive in both.
        window: the first distance that uses the far regime (Self-Extend's ``W``, >= 1).
        scaling: the softmax scale.
        max_distance: keys farther than this are not read (a sliding window), or None.
        block_sizes: ``(BLOCK_M, BLOCK_N[, num_warps, num_stages])`` instead of the defaults (tests
            under the interpreter, tuning).
        far_rows: the first query row that each tensor of ``k_far`` serves (0, then increasing):
            ``k_far[g]`` serves rows ``far_rows[g] ... far_rows[g + 1] - 1``. Every group runs in
            one launch, so the GPU stays busy where one launch per group would leave it idle at
            each launch's tail.

    Forward only (no gradient). A row with no key in reach (keys that all lie after it, or beyond
    ``max_distance``) gets zeros, as the partial-softmax path gives an empty row.
    """
    if triton is None:
        raise RuntimeError("two_regime_attention needs Triton (installed with PyTorch's CUDA wheels).")
    if far_rows is not None and not isinstance(far_rows, (list, tuple)):
        try:  # an iterator is read once, here: the checks and the block table see the same rows
            far_rows = tuple(far_rows)
        except TypeError:
            raise ValueError(f"far_rows must be a sequence of whole numbers, got {far_rows!r}.") from None
    _check_arguments(q_near, q_far, k_near, k_far, value, first_distance, window, max_distance, block_sizes, far_rows)
    first_distance, window = operator.index(first_distance), operator.index(window)
    max_distance = None if max_distance is None else operator.index(max_distance)
    batch, heads, rows, head_dim = q_near.shape
    key_heads, keys = k_near.shape[1], k_near.shape[2]
    starts = [0] if far_rows is None else [operator.index(row) for row in far_rows]
    far_keys = [k_far] if far_rows is None else list(k_far)
    q_near, q_far, k_near, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (q_near, q_far, k_near, value))
    groups = list(range(len(far_keys)))
    if len(far_keys) == 1:
        k_far, group_stride = far_keys[0] if far_keys[0].stride(-1) == 1 else far_keys[0].contiguous(), 0
    elif (spaced := _slices_of_one_tensor(far_keys)) is not None:  # the patch's own: no copy
        k_far, group_stride, groups = spaced
    else:  # one tensor, so that the kernel reaches every group from one pointer
        stacked = torch.stack(far_keys)
        k_far, group_stride = stacked[0], stacked.stride(0)
    output = torch.empty(batch, heads, rows, head_dim, dtype=q_near.dtype, device=q_near.device)
    if rows == 0:
        return output
    block_m, block_n, warps, stages = _blocks(head_dim, q_near.dtype)
    if block_sizes is not None:  # (BLOCK_M, BLOCK_N) or (BLOCK_M, BLOCK_N, num_warps, num_stages)
        block_m, block_n, warps, stages = (*block_sizes, warps, stages)[:4]
    windowed = max_distance is not None
    # "no window": a distance no pair reaches, kept inside int32
    limit = max_distance if windowed else first_distance + rows + 1
    table = _block_table(tuple(starts), tuple(groups), rows, block_m, q_near.device)
    grid = (table.numel() // 3, batch * heads)
    # Triton launches on the current CUDA device: a model spread over several GPUs has this
    # layer's tensors on another one
    with torch.cuda.device(q_near.device) if q_near.device.type == "cuda" else contextlib.nullcontext():
        _two_regime_kernel[grid](
            q_near, q_far, k_near, k_far, value, output, table,
            *q_near.stride()[:3], *q_far.stride()[:3], *k_near.stride()[:3], *k_far.stride()[:3], *value.stride()[:3],
            *output.stride()[:3], group_stride,
            heads, heads // key_heads, keys,
            first_distance, window, limit, float(scaling) * _LOG2_E,
            HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, WINDOWED=windowed,
            PRECISION="ieee" if q_near.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages,
        )
    return output
