"""Which rows each KV head of a store holds, when the heads hold different rows (docs/compression.md §1, §11.1).

A store whose KV heads keep different rows (an eviction, or rows kept per head then quantized) chose them out of
a SPAN: the append indices of the stores it was made from, named by a few ``(start, length)`` runs as an
uncompressed store names its own (:mod:`.index_runs`). Its :class:`RowIndex` names each head's rows within that
span in the cheaper of two encodings, by their real bytes (:func:`row_index_bytes`):

- ``bitmap``: ``[Hkv, ceil(S / 8)]`` uint8, bit ``p`` of head ``h`` set when the span's ``p``-th row is kept
  (bits little-endian within a byte). When the store keeps ``0 < R < n`` residual rows at the end of its order
  (a quantized store's full-precision rows, :func:`~unicache_core.compression.selection.residual_last`), a second
  ``[Hkv, ceil(n / 8)]`` uint8 bitmap flags them among each head's kept rows in ascending order; the store order is
  then the unflagged rows ascending, then the flagged ones ascending.
- ``list``: ``[Hkv, n]`` int32 append indices in store order (any order), ``4 * Hkv * n`` bytes.

The rule: the bitmap when its bytes are at most the list's, else the list (a very sparse selection over a long
span); a selection whose order the bitmap cannot express (not ascending within each part) is listed. The runs are a
handful of Python integers per store, like the cache's per-row type map, and are not charged.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from . import quant
from .index_runs import runs_index

#: ``((first append index, length), ...)``: a span of append indices as runs.
Runs = tuple[tuple[int, int], ...]


def span_length(span: Runs) -> int:
    """Rows the span names."""
    return sum(n for _, n in span)


def merge_spans(spans: Iterable[Runs]) -> Runs:
    """The union of several spans as maximal runs in append order (adjacent runs joined)."""
    runs = sorted((int(a), int(n)) for span in spans for a, n in span if n > 0)
    out: list[tuple[int, int]] = []
    for start, length in runs:
        if out and start <= out[-1][0] + out[-1][1]:
            last_start, last_len = out[-1]
            out[-1] = (last_start, max(last_len, start + length - last_start))
        else:
            out.append((start, length))
    return tuple(out)


def bitmap_bytes(num_heads: int, rows: int, span: int, residual: int = 0) -> int:
    """Bytes of the bitmap encoding: the kept-row bitmap, plus the residual flags when ``0 < residual < rows``."""
    flags = -(-rows // 8) if 0 < min(residual, rows) < rows else 0
    return num_heads * (-(-span // 8) + flags)


def list_bytes(num_heads: int, rows: int) -> int:
    """Bytes of the list encoding: one int32 per kept row per head."""
    return 4 * num_heads * rows


def uses_bitmap(num_heads: int, rows: int, span: int, residual: int = 0) -> bool:
    """The rule: the bitmap when it holds at most the list's bytes."""
    return bitmap_bytes(num_heads, rows, span, residual) <= list_bytes(num_heads, rows)


def row_index_bytes(num_heads: int, rows: int, span: int, residual: int = 0) -> int:
    """Bytes a :class:`RowIndex` of ``rows`` rows per head out of a ``span``-row span holds (its ``residual`` last
    rows in store order flagged): the cheaper encoding's."""
    return min(bitmap_bytes(num_heads, rows, span, residual), list_bytes(num_heads, rows))


def pack_bits(mask: Tensor) -> Tensor:
    """``[H, S]`` bool → ``[H, ceil(S / 8)]`` uint8, bit ``p % 8`` of byte ``p // 8`` (the 1-bit codes of
    :func:`.quant.pack_bits`)."""
    return quant.pack_bits(mask.to(torch.uint8), 1)


def unpack_bits(packed: Tensor, length: int) -> Tensor:
    """``[H, B]`` uint8 of :func:`pack_bits` → ``[H, length]`` bool."""
    return quant.unpack_bits(packed, 1, length).bool()


def span_positions(span: Runs, index: Tensor) -> Tensor:
    """Positions in the span (0 .. S-1) of the append indices ``index`` (int64, same shape); -1 where outside it."""
    if not span:
        return torch.full_like(index, -1)
    starts = torch.tensor([a for a, _ in span], dtype=torch.int64, device=index.device)
    lengths = torch.tensor([n for _, n in span], dtype=torch.int64, device=index.device)
    offsets = torch.cumsum(lengths, 0) - lengths
    run = (torch.searchsorted(starts, index.contiguous(), right=True) - 1).clamp(min=0)
    inside = (index >= starts[run]) & (index < starts[run] + lengths[run])
    return torch.where(inside, offsets[run] + index - starts[run], torch.full_like(index, -1))


class RowIndex:
    """Each KV head's rows of a store, named within the store's span (module docstring).

    Attributes:
        span: the runs the rows were chosen from.
        num_heads, rows: ``Hkv`` and the rows per head ``n``.
        residual: the last rows of each head's store order that the bitmap flags (0 when not flagged).
        bitmap: ``[Hkv, ceil(S / 8)]`` uint8, or ``None`` (list encoding).
        flags: ``[Hkv, ceil(n / 8)]`` uint8 residual flags, or ``None``.
        listed: ``[Hkv, n]`` int32 append indices in store order, or ``None`` (bitmap encoding).
    """

    __slots__ = ("bitmap", "flags", "listed", "num_heads", "residual", "rows", "span")

    def __init__(
        self, span: Runs, num_heads: int, rows: int, residual: int,
        bitmap: Tensor | None, flags: Tensor | None, listed: Tensor | None,
    ):  # fmt: skip
        self.span, self.num_heads, self.rows, self.residual = tuple(span), num_heads, rows, residual
        self.bitmap, self.flags, self.listed = bitmap, flags, listed

    @classmethod
    def encode(cls, index: Tensor, span: Runs | None = None, residual: int = 0) -> RowIndex:
        """Name ``index [Hkv, n]`` (append indices in store order, distinct per head, its last ``residual`` rows the
        store's residual) within ``span`` (default: the runs of every row any head holds) by :func:`uses_bitmap`."""
        if index.dim() != 2:
            raise ValueError(f"a row index names [Hkv, n] rows, got shape {tuple(index.shape)}")
        h, n = index.shape
        idx = index.long()
        if span is None:
            span = merge_spans([tuple((int(a), 1) for a in torch.unique(idx.cpu()).tolist())])
        span = tuple(span)
        residual = max(0, min(int(residual), n))
        position = span_positions(span, idx)
        if n and bool((position < 0).any()):
            raise ValueError(f"the rows {index.tolist()} are not all inside the span {span}")
        size = span_length(span)
        flagged = 0 < residual < n
        body, tail = position[:, : n - residual], position[:, n - residual :]
        ordered = all(part.shape[1] < 2 or bool((part[:, 1:] > part[:, :-1]).all()) for part in (body, tail))
        if not ordered or not uses_bitmap(h, n, size, residual):
            return cls(span, h, n, 0, None, None, index.to(torch.int32, copy=True).contiguous())
        mask = torch.zeros(h, size, dtype=torch.bool, device=index.device)
        mask.scatter_(1, position, True)
        if bool(mask.sum(dim=1).ne(n).any()):  # a head repeats a row: only the list names it
            return cls(span, h, n, 0, None, None, index.to(torch.int32, copy=True).contiguous())
        flags = None
        if flagged:
            rank = torch.argsort(position, dim=1)  # store positions in ascending order
            flags = pack_bits(rank >= n - residual)
        return cls(span, h, n, residual if flagged else 0, pack_bits(mask), flags, None)

    @property
    def encoding(self) -> str:
        """``"bitmap"`` or ``"list"``."""
        return "list" if self.listed is not None else "bitmap"

    @property
    def device(self) -> torch.device:
        held = self.listed if self.listed is not None else self.bitmap
        assert held is not None
        return held.device

    def positions(self) -> Tensor:
        """``[Hkv, n]`` int64 positions in the span, in store order."""
        if self.listed is not None:
            return span_positions(self.span, self.listed.long())
        assert self.bitmap is not None
        h, n = self.num_heads, self.rows
        kept = torch.nonzero(unpack_bits(self.bitmap, span_length(self.span)))[:, 1].reshape(h, n)
        if self.flags is not None:
            flagged = unpack_bits(self.flags, n).long()
            order = torch.argsort(flagged * n + torch.arange(n, device=kept.device), dim=1)
            kept = torch.gather(kept, 1, order)
        return kept

    def decode(self) -> Tensor:
        """``[Hkv, n]`` int32 append indices in store order."""
        if self.listed is not None:
            return self.listed
        if self.rows == 0:
            return torch.zeros(self.num_heads, 0, dtype=torch.int32, device=self.device)
        return runs_index(self.span, self.device)[self.positions()]

    def take(self, rows: Tensor) -> RowIndex:
        """The index of the store rows ``rows [Hkv, m]`` (positions into this index's store order, ascending append
        order per head), within the same span, with no residual."""
        picked = torch.gather(self.decode().long(), 1, rows.long().to(self.device))
        return RowIndex.encode(picked, self.span)

    def tensors(self) -> list[Tensor]:
        """The tensors held (the list, or the bitmap and its flags)."""
        return [t for t in (self.bitmap, self.flags, self.listed) if t is not None]

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def nominal_bytes(self) -> int:
        """:func:`row_index_bytes` of this index's geometry (its real bytes unless a listed order forced the list)."""
        if self.listed is not None:
            return list_bytes(self.num_heads, self.rows)
        return bitmap_bytes(self.num_heads, self.rows, span_length(self.span), self.residual)


__all__ = [
    "RowIndex",
    "Runs",
    "bitmap_bytes",
    "list_bytes",
    "merge_spans",
    "pack_bits",
    "row_index_bytes",
    "span_length",
    "span_positions",
    "unpack_bits",
    "uses_bitmap",
]
