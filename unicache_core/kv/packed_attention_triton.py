"""Attention over a :class:`~unicache_core.kv.quantized_store.QuantizedStore`'s packed rows as a Triton kernel.

The torch path of ``QuantizedStore.attend`` dequantizes the packed rows to the queries' dtype in chunks, then calls
the fused attention: the packed bytes save memory but not bandwidth. This kernel reads the packed codes, their
scales and zeros inside the attention (a flash-attention loop whose key and value tiles are dequantized in
registers) and returns the output and the log-sum-exp, so its result merges with the other parts of a layer
exactly as the torch path's does (:func:`~unicache_core.kv.attention.merge_attention`).

Layouts read (those of :mod:`unicache_core.kv.quant`): codes ``[Hkv, T, ceil(d * b / 8)]`` uint8, ``8 // b`` codes a
byte along the channels, the first in the low bits, ``b`` in 1, 2, 4, 8 (keys and values alike); keys per channel
(scales and zeros ``[Hkv, ceil(T / G), d]``: row ``t`` reads group ``t // G``, the last group may be short) or per token
(``[Hkv, T, ceil(d / G)]``, docs/compression.md §11.13), values per token (channel ``c`` reads group ``c // G``, the
last may be short); scales and zeros fp16 or fp32. The rows of every KV head are its own head-major slice, whether
the heads share their rows (a ``[T]`` index) or hold different ones (a :class:`~unicache_core.kv.row_index.RowIndex`):
attention over a store reads all of its rows and never the index. The residual rows (full precision, the cache
dtype) go through :func:`~unicache_core.kv.attention.attention_with_lse` and merge by log-sum-exp.

Queries ``[Tq, Hq, d]`` (fp32, fp16 or bf16; ``Hq`` a multiple of ``Hkv``): the ``Hq // Hkv`` query heads of a KV
head are folded into one row axis of ``(Hq // Hkv) * Tq`` rows, so one query (decode) and thousands (a denoising
step's latent, non-causal) run the same kernel; the rows are split over programs (flash-decoding's split of the
keys) when the queries alone would leave the device idle, and the splits merge by log-sum-exp.

Triton is imported only when a kernel is first built (:func:`kernels`); this module imports without it and does
nothing at import. The kernel functions below are plain Python until then: :func:`kernels` copies them into a
namespace of their own holding ``triton.language`` and decorates them there with ``triton.jit`` (the interpreter
writes its helpers into that namespace, not into this module). ``triton.jit`` reads Triton's interpreter switch
(``TRITON_INTERPRET``) when it decorates, and Triton decorates its own standard library (``tl.zeros``, ``tl.max``)
when it is first imported, so the interpreter runs the kernel only in a process that imported Triton with the switch
on: the unit tests start one (tests/packed_kernel_cases.py), running the very code the GPU compiles, on CPU tensors.
One difference there: the interpreter multiplies no bf16, so bf16 tiles, rounded to bf16 as on the GPU, are
multiplied in fp32 (``UPCAST_DOT``).

:func:`packed_attention_kernel` selects it: for CUDA queries when Triton is importable and the store's layout is one
the kernel reads (:func:`unsupported`: fp32, fp16 or bf16 queries, head dims 16 to 256), else ``None`` (the torch
path), each reason logged once; a layout Triton fails to compile or launch goes to the torch path from then on,
logged once. ``QuantizedStore.attend`` and the fused path of ``SegmentedLayer.attend`` ask it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import types
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from .attention import attention_with_lse, merge_attention
from .quant import QuantizedTensor

logger = logging.getLogger(__name__)

#: ``triton.language`` inside the decorated copies of the kernel functions (:func:`kernels`); unused before.
tl: Any = None

#: Key rows per tile on a GPU; the row splits of one program are multiples of it.
BLOCK_N = 64
#: Programs per streaming multiprocessor the row split aims at (flash-decoding's occupancy rule).
PROGRAMS_PER_SM = 4


class PackedKV(Protocol):
    """What the kernel reads of a quantized store (:class:`~unicache_core.kv.quantized_store.QuantizedStore`)."""

    qkeys: QuantizedTensor
    qvalues: QuantizedTensor
    res_keys: Tensor
    res_values: Tensor

    def attend(self, q: Tensor, scale: float | None = None) -> tuple[Tensor, Tensor]: ...


def _dequant_tile(codes, scale, zero, head, rows, cols, mask, code_h, code_r, meta_h, meta_r, bits, rows_per, cols_per):
    """fp32 ``[len(rows), len(cols)]`` tile of a packed tensor: ``code * s + z``, the code ``c`` of row ``t`` in byte
    ``c // (8 // bits)`` at bit ``(c % (8 // bits)) * bits``, its scale and zero at group ``(t // rows_per, c //
    cols_per)`` (keys per channel: ``rows_per = G, cols_per = 1``; per token: ``1, G``). Masked entries read 0."""
    per = 8 // bits
    byte = tl.load(codes + head * code_h + rows[:, None] * code_r + (cols // per)[None, :], mask=mask, other=0)
    code = (byte.to(tl.int32) >> ((cols % per) * bits)[None, :]) & ((1 << bits) - 1)
    meta = head * meta_h + (rows // rows_per)[:, None] * meta_r + (cols // cols_per)[None, :]
    s = tl.load(scale + meta, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(zero + meta, mask=mask, other=0.0).to(tl.float32)
    return code.to(tl.float32) * s + z


def _packed_attention_fwd(
    q_ptr, kc, ks, kz, vc, vs, vz, out_ptr, lse_ptr,
    qk_scale, n_rows, split_rows, q_rows, group, hq, head_dim,
    kc_h, kc_r, km_h, km_r, vc_h, vc_r, vm_h, vm_r,
    KEY_BITS: tl.constexpr, VALUE_BITS: tl.constexpr, KEY_ROWS_PER: tl.constexpr, KEY_COLS_PER: tl.constexpr,
    VALUE_COLS_PER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    """One program: ``BLOCK_M`` folded query rows of KV head ``program_id(1)`` over the rows of split
    ``program_id(2)``; writes the split's fp32 output ``[Tq, Hq, d]`` and natural-log LSE ``[Tq, Hq]`` slices
    (``-inf`` and 0 where the split holds no row). ``qk_scale`` is the softmax scale times ``log2(e)``."""
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    # folded row m is query token m // group of query head head * group + m % group; q is [Tq, Hq, d] contiguous
    q_off = ((m // group) * hq + head * group + m % group) * head_dim
    col_ok = cols < head_dim
    q_mask = (m < q_rows)[:, None] & col_ok[None, :]
    q = tl.load(q_ptr + q_off[:, None] + cols[None, :], mask=q_mask, other=0.0)
    tile = q.dtype  # the dequantized tiles are rounded to the queries' dtype, as the torch path dequantizes them
    if UPCAST_DOT:  # Triton's interpreter multiplies no bf16: the same rounded values, multiplied in fp32
        q = q.to(tl.float32)
    start = split * split_rows
    stop = tl.minimum(start + split_rows, n_rows)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        rows = n0 + tl.arange(0, BLOCK_N)
        row_ok = rows < stop
        kv_mask = row_ok[:, None] & col_ok[None, :]
        k = _dequant_tile(kc, ks, kz, head, rows, cols, kv_mask, kc_h, kc_r, km_h, km_r, KEY_BITS, KEY_ROWS_PER,
                          KEY_COLS_PER)  # fmt: skip
        scores = tl.dot(q, tl.trans(k.to(tile).to(q.dtype)), input_precision=PRECISION) * qk_scale
        scores = tl.where(row_ok[None, :], scores, float("-inf"))
        # every tile holds at least one row of the split, so m_new is finite
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _dequant_tile(vc, vs, vz, head, rows, cols, kv_mask, vc_h, vc_r, vm_h, vm_r, VALUE_BITS, 1,
                          VALUE_COLS_PER)  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(p.to(tile).to(q.dtype), v.to(tile).to(q.dtype), input_precision=PRECISION)
        m_i = m_new
    held = l_i > 0
    out = acc / tl.where(held, l_i, 1.0)[:, None]
    lse = tl.where(held, (m_i + tl.log2(tl.where(held, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    base = split * (q_rows // group) * hq  # the split's [Tq, Hq] slice
    tl.store(out_ptr + base * head_dim + q_off[:, None] + cols[None, :], out, mask=q_mask)
    tl.store(lse_ptr + base + (m // group) * hq + head * group + m % group, lse, mask=m < q_rows)


#: The kernel functions of this module in dependency order (each decorated after those it calls).
KERNEL_FUNCTIONS = ("_dequant_tile", "_packed_attention_fwd")


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool) -> types.SimpleNamespace:
    import triton
    import triton.language as language

    namespace = dict(globals(), tl=language, triton=triton)
    for name in KERNEL_FUNCTIONS:
        fn = globals()[name]
        copy = types.FunctionType(fn.__code__, namespace, name, fn.__defaults__, fn.__closure__)
        copy.__doc__, copy.__module__, copy.__qualname__ = fn.__doc__, fn.__module__, fn.__qualname__
        namespace[name] = triton.jit(copy)
    return types.SimpleNamespace(**{name: namespace[name] for name in KERNEL_FUNCTIONS}, interpret=interpret)


def kernels() -> types.SimpleNamespace:
    """The decorated kernels (attribute ``name`` for each of :data:`KERNEL_FUNCTIONS`, and ``interpret``) for the
    interpreter switch's value now (``TRITON_INTERPRET``), built once per value. Imports Triton (``ImportError``
    without it)."""
    import triton

    return _kernels(bool(triton.knobs.runtime.interpret))


def _meta_strides(qt: QuantizedTensor) -> tuple[int, int, int, int]:
    """``(head stride, row stride, rows per group, channels per group)`` of ``qt``'s scales and zeros, contiguous."""
    _, groups, width = qt.scale.shape
    if qt.axis == "channel":  # [Hkv, ceil(T / G), d]: row t reads group t // G, every channel its own
        return groups * width, width, qt.group_size, 1
    # [Hkv, T, ceil(d / G)]: channel c reads group c // G; one group per row when G >= d (c // G = 0)
    return groups * width, width, 1, qt.group_size


@functools.lru_cache(maxsize=8)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _split(n_rows: int, programs: int, device: torch.device, block_n: int, splits: int | None) -> tuple[int, int]:
    """``(splits, rows per split)``: whole tiles per split, enough splits for :data:`PROGRAMS_PER_SM` programs per
    multiprocessor (8 programs off CUDA) or ``splits`` when given, and never a split without rows."""
    tiles = -(-n_rows // block_n)
    if splits is None:
        target = 8
        if device.type == "cuda":
            target = PROGRAMS_PER_SM * _multiprocessors(device)
        splits = -(-target // max(1, programs))
    per_split = -(-tiles // max(1, min(splits, tiles))) * block_n
    return -(-n_rows // per_split), per_split


def _merge_splits(out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """Merge ``out [S, Tq, Hq, d]`` and ``lse [S, Tq, Hq]`` (fp32) over the splits by log-sum-exp."""
    if out.shape[0] == 1:
        return out[0], lse[0]
    total = torch.logsumexp(lse, dim=0)
    weights = torch.nan_to_num(torch.exp(lse - total.clamp_min(torch.finfo(torch.float32).min)), nan=0.0)
    return torch.einsum("stk,stkd->tkd", weights, out), total


class LaunchGrid(NamedTuple):
    """How :func:`quantized_part` launches: ``BLOCK_M`` folded query rows a program, ``m_blocks`` programs over them
    per KV head, ``splits`` programs over the rows (``rows_per_split`` each), ``BLOCK_N`` rows a tile."""

    block_m: int
    m_blocks: int
    splits: int
    rows_per_split: int
    block_n: int


def launch_grid(store: PackedKV, q: Tensor, block_n: int | None = None, splits: int | None = None) -> LaunchGrid:
    """The launch of ``q [Tq, Hq, d]`` over ``store`` (``block_n``, ``splits``: :func:`quantized_part`)."""
    tq, hq, _ = q.shape
    hkv = store.qkeys.packed.shape[0]
    block_n = BLOCK_N if block_n is None else block_n
    rows = (hq // hkv) * tq
    block_m = 16 if rows <= 16 else 64
    m_blocks = -(-rows // block_m)
    n_splits, per_split = _split(store.qkeys.num_tokens, m_blocks * hkv, q.device, block_n, splits)
    return LaunchGrid(block_m, m_blocks, n_splits, per_split, block_n)


def quantized_part(
    store: PackedKV, q: Tensor, scale: float, *, block_n: int | None = None, splits: int | None = None
) -> tuple[Tensor, Tensor]:
    """The kernel's attention of ``q [Tq, Hq, d]`` over the store's quantized rows (at least one): ``(out [Tq, Hq, d],
    lse [Tq, Hq])`` fp32. ``block_n`` and ``splits`` override the tile rows and the row split (the tests take small
    ones). Every tensor on one device: CUDA, or the CPU under Triton's interpreter."""
    k, v = store.qkeys, store.qvalues
    tq, hq, d = q.shape
    hkv, n = k.packed.shape[0], k.num_tokens
    group = hq // hkv
    grid = launch_grid(store, q, block_n, splits)
    out = torch.empty(grid.splits, tq, hq, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(grid.splits, tq, hq, dtype=torch.float32, device=q.device)
    km_h, km_r, key_rows_per, key_cols_per = _meta_strides(k)
    vm_h, vm_r, _, value_cols_per = _meta_strides(v)
    kc, vc = k.packed.contiguous(), v.packed.contiguous()
    built = kernels()
    upcast = built.interpret and q.dtype == torch.bfloat16
    built._packed_attention_fwd[(grid.m_blocks, hkv, grid.splits)](
        q.contiguous(), kc, k.scale.contiguous(), k.zero.contiguous(), vc, v.scale.contiguous(), v.zero.contiguous(),
        out, lse, scale * math.log2(math.e), n, grid.rows_per_split, group * tq, group, hq, d,
        kc.stride(0), kc.stride(1), km_h, km_r, vc.stride(0), vc.stride(1), vm_h, vm_r,
        KEY_BITS=k.bits, VALUE_BITS=v.bits, KEY_ROWS_PER=key_rows_per, KEY_COLS_PER=key_cols_per,
        VALUE_COLS_PER=value_cols_per, BLOCK_M=grid.block_m, BLOCK_N=grid.block_n, BLOCK_D=max(16, _next_pow2(d)),
        PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32", UPCAST_DOT=upcast,
    )  # fmt: skip
    return _merge_splits(out, lse)


def _next_pow2(n: int) -> int:
    """The least power of two ``>= n``."""
    return 1 << max(0, (int(n) - 1).bit_length())


def packed_attention(
    store: PackedKV, q: Tensor, scale: float | None = None, *, block_n: int | None = None, splits: int | None = None
) -> tuple[Tensor, Tensor]:
    """``QuantizedStore.attend`` by the kernel: ``q [Tq, Hq, d]`` over the quantized rows (the kernel) and the residual
    rows (:func:`~unicache_core.kv.attention.attention_with_lse`), merged; ``(out [Tq, Hq, d]`` in ``q.dtype``, ``lse
    [Tq, Hq]`` fp32). ``block_n``, ``splits``: :func:`quantized_part`."""
    hkv, d = store.res_keys.shape[0], store.res_keys.shape[2]
    if q.dim() != 3 or q.shape[2] != d or q.shape[1] % hkv:
        raise ValueError(f"queries must be [Tq, Hq, {d}] with Hq a multiple of {hkv} KV heads, got {tuple(q.shape)}")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    res_k = store.res_keys.to(q.dtype).transpose(0, 1)
    res_v = store.res_values.to(q.dtype).transpose(0, 1)
    if store.qkeys.num_tokens == 0 or q.shape[0] == 0:
        return attention_with_lse(q, res_k, res_v, scale=scale)
    parts = [quantized_part(store, q, scale, block_n=block_n, splits=splits)]
    if res_k.shape[0]:
        parts.append(attention_with_lse(q, res_k, res_v, scale=scale))
    out, lse = merge_attention(parts)
    return out.to(q.dtype), lse


#: Query dtypes the kernel reads.
QUERY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Head dims the kernel takes: ``tl.dot`` needs 16 at least, and a tile of more than 256 channels spills.
HEAD_DIMS = range(16, 257)
_LOGGED: set[str] = set()
#: Layouts whose kernel failed to compile or launch on this device (the torch path serves them from then on).
_FAILED: set[tuple] = set()
_ENABLED = [True]


def _log_once(reason: str) -> None:
    if reason not in _LOGGED:
        _LOGGED.add(reason)
        logger.info("packed KV attention: %s; dequantizing and attending in torch", reason)


@functools.lru_cache(maxsize=1)
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        _log_once(f"Triton is not importable ({exc})")
        return False
    return True


def _layout(store: PackedKV, q: Tensor) -> tuple:
    """What a compiled kernel specializes on, beside the shapes."""
    k, v = store.qkeys, store.qvalues
    return (q.device, q.dtype, q.shape[-1], k.bits, v.bits, k.axis, k.group_size, v.group_size)


def unsupported(store: PackedKV, q: Tensor) -> str | None:
    """Why the kernel does not take ``q [Tq, Hq, d]`` over ``store`` (``None``: it does)."""
    k, v = store.qkeys, store.qvalues
    if q.dtype not in QUERY_DTYPES:
        return f"queries in {q.dtype}"
    if q.shape[-1] not in HEAD_DIMS or k.head_dim != q.shape[-1]:
        return f"head dim {q.shape[-1]} (the kernel takes {HEAD_DIMS.start} to {HEAD_DIMS.stop - 1})"
    if v.axis != "token":
        return "values grouped per channel"
    if q.dim() != 3 or q.shape[1] % max(1, k.packed.shape[0]):
        return f"queries {tuple(q.shape)} over {k.packed.shape[0]} KV heads"
    if any(t.device != q.device for t in (k.packed, k.scale, v.packed, v.scale, store.res_keys)):
        return "the store is on another device than the queries"
    return None


def _on_cuda(q: Tensor) -> bool:
    return q.is_cuda


def packed_attention_kernel(store: PackedKV, q: Tensor) -> Callable[[PackedKV, Tensor, float | None], Any] | None:
    """The kernel for ``q`` over ``store`` (called as ``kernel(store, q, scale)``, returning ``(out, lse)``), or
    ``None`` for the torch path: queries off CUDA (no log), Triton not importable, :func:`unsupported` (logged once
    each), a layout the kernel failed on (logged when it failed), or the kernel switched off
    (:func:`kernel_disabled`)."""
    if not _on_cuda(q) or not _ENABLED[0] or not _triton_importable() or _layout(store, q) in _FAILED:
        return None
    reason = unsupported(store, q)
    if reason is not None:
        _log_once(reason)
        return None
    return _attend_or_fall_back


def _attend_or_fall_back(store: PackedKV, q: Tensor, scale: float | None = None) -> tuple[Tensor, Tensor]:
    """:func:`packed_attention`; a layout Triton cannot compile or launch goes to the torch path (logged once), and
    stays there."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    try:
        return packed_attention(store, q, scale)
    except (CompilationError, OutOfResources) as exc:
        _FAILED.add(_layout(store, q))
        _log_once(f"the kernel failed for {_layout(store, q)[1:]} ({type(exc).__name__}: {exc})")
    return store.attend(q, scale)


@contextlib.contextmanager
def kernel_disabled() -> Iterator[None]:
    """Within it, :func:`packed_attention_kernel` selects the torch path (a benchmark's baseline)."""
    saved = _ENABLED[0]
    _ENABLED[0] = False
    try:
        yield
    finally:
        _ENABLED[0] = saved


__all__ = [
    "BLOCK_N",
    "HEAD_DIMS",
    "KERNEL_FUNCTIONS",
    "LaunchGrid",
    "PackedKV",
    "QUERY_DTYPES",
    "kernel_disabled",
    "kernels",
    "launch_grid",
    "packed_attention",
    "packed_attention_kernel",
    "quantized_part",
    "unsupported",
]
