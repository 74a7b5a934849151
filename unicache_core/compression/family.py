"""The (rows kept, bits) family of one token type: eviction and quantization are its two ends.

A type of ``n`` rows may keep ``rows <= n`` rows per KV head (chosen by its scores) at ``bits`` in {2, 4, 8} (KIVI
layout, docs/compression.md §6) or at full precision (:data:`FULL_BITS`). ``rows < n`` at full precision is eviction,
``rows = n`` at b bits is quantization, anything between is a joint choice (docs/compression.md §11). Below the 2-bit
floor a segment of fewer rows than channels may group its keys per token, and values may take fewer bits (§11.13).

Quantization geometry follows the segment and the budget (§11.2): the bits and group are the most
precise whose every row fits the budget; the full-precision residual then takes the bytes left, up to
``min(residual_max, floor(rows * residual_share))`` rows (the type's best-scored rows); key groups run
over the quantized rows, so a segment shorter than its group is one group of its own length. Every choice is costed with
the REAL bytes its store will hold (payload, fp16 scale/zero, residual, its row index), and a choice never holds more
than the rows' uncompressed K and V.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from ..kv.quant import PACKED_BITS, SUPPORTED_BITS, StoreLayout, quantized_kv_nbytes
from ..kv.row_index import row_index_bytes
from .defaults import JOINT_BITS, JOINT_LEVELS, KIVI_GROUPS, KIVI_RESIDUAL, KIVI_RESIDUAL_SHARE

#: ``bits`` of rows kept at the cache's own precision (evicted or uncompressed rows).
FULL_BITS = 16
#: Every bit width of the family, most precise first.
FAMILY_BITS: tuple[int, ...] = (FULL_BITS, *sorted(SUPPORTED_BITS, reverse=True))


@dataclass(frozen=True)
class QuantGeometry:
    """How quantized rows are laid out for one model (a policy table may carry its own, §11.2).

    Attributes:
        groups: the KIVI group sizes the lookup may use (key groups run over tokens, value groups over
            channels).
        residual_max: most rows a quantized segment keeps in full precision (its residual).
        residual_share: the residual never holds more than this share of the segment's rows.
    """

    groups: tuple[int, ...] = KIVI_GROUPS
    residual_max: int = KIVI_RESIDUAL
    residual_share: float = KIVI_RESIDUAL_SHARE

    def __post_init__(self) -> None:
        groups = tuple(self.groups)
        if not groups or any(isinstance(g, bool) or not isinstance(g, int) or g < 1 for g in groups):
            raise ValueError(f"`groups` must be a non-empty list of ints >= 1, got {self.groups!r}")
        object.__setattr__(self, "groups", tuple(sorted(set(groups))))
        if isinstance(self.residual_max, bool) or not isinstance(self.residual_max, int) or self.residual_max < 0:
            raise ValueError(f"`residual_max` must be an int >= 0, got {self.residual_max!r}")
        share = self.residual_share
        if (
            isinstance(share, bool)
            or not isinstance(share, (int, float))
            or not math.isfinite(share)
            or not 0.0 <= share <= 1.0
        ):
            raise ValueError(f"`residual_share` must be a number in [0, 1], got {share!r}")

    def residual(self, rows: int) -> int:
        """The most full-precision residual rows a quantized segment of ``rows`` rows may keep."""
        return min(self.residual_max, int(math.floor(rows * self.residual_share + 1e-9)))

    def with_residual(self, residual: int | None) -> QuantGeometry:
        """This geometry with a fixed number of full-precision residual rows when ``residual`` is set (at most the
        segment, dropped when it does not fit the budget); ``None``: the residual follows the segment's length."""
        if residual is None:
            return self
        if isinstance(residual, bool) or not isinstance(residual, int) or residual < 0:
            raise ValueError(f"`residual` must be an integer >= 0 or None, got {residual!r}")
        return replace(self, residual_max=residual, residual_share=1.0)

    def to_dict(self) -> dict:
        return {"groups": list(self.groups), "residual_max": self.residual_max, "residual_share": self.residual_share}

    @classmethod
    def from_dict(cls, data: Mapping) -> QuantGeometry:
        """Parse ``{"groups": [...], "residual_max": R, "residual_share": s}`` (missing keys: the defaults)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"quantization geometry must be an object, got {type(data).__name__}")
        unknown = set(data) - {"groups", "residual_max", "residual_share"}
        if unknown:
            raise ValueError(
                f"quantization geometry has unknown keys {sorted(unknown)} "
                "(known: groups, residual_max, residual_share)"
            )
        groups = data.get("groups", list(KIVI_GROUPS))
        if not isinstance(groups, list):
            raise ValueError(f"`groups` must be a list of ints, got {groups!r}")
        return cls(
            groups=tuple(groups),
            residual_max=data.get("residual_max", KIVI_RESIDUAL),
            residual_share=data.get("residual_share", KIVI_RESIDUAL_SHARE),
        )


@dataclass(frozen=True)
class JointChoice:
    """What one type holds: ``rows`` per KV head at ``bits`` (:data:`FULL_BITS`: full precision)."""

    rows: int
    bits: int = FULL_BITS
    group: int = 0  # quantized choices only
    residual: int = 0  # quantized choices only
    value_bits: int | None = None  # quantized choices only: the values' bits when fewer than the keys' (§11.13)
    key_per_token: bool = False  # quantized choices only: keys grouped per token (§11.13)

    @property
    def quantized(self) -> bool:
        return self.bits != FULL_BITS

    @property
    def layout(self) -> StoreLayout:
        """The store layout of a quantized choice (its value bits and key groups)."""
        return StoreLayout(self.value_bits, self.key_per_token)

    @property
    def vbits(self) -> int:
        """The values' bits (``bits`` unless fewer)."""
        return self.bits if self.value_bits is None else self.value_bits


@dataclass(frozen=True)
class Segment:
    """The rows of one type in one layer as a choice sees them.

    Attributes:
        full_rows: ``n``, rows the type had uncompressed.
        held_rows: rows per KV head it holds now; held_bits: their bits (:data:`FULL_BITS` when full/evicted);
            held_bytes: the bytes its stores hold now; held_value_bits: its values' bits when fewer than
            ``held_bits`` (``None``: the same).
        kept_mass: ``kept_mass[k]`` is the share of the held rows' attention mass its ``k`` best-scored rows drew
            (``k = 0 .. held_rows``; ``None``: every row alike), what :func:`choice_error` weighs dropped rows by.
        shared_rows: every KV head holds the same rows (an uncompressed or wholly quantized segment).
        num_kv_heads, head_dim, elem: geometry of a row (``elem``: bytes per element of the cache dtype).
        span_rows: rows of the span a store of rows chosen per KV head names its rows within (the rows its stores
            were made from, :class:`~unicache_core.kv.row_index.RowIndex`; ``None``: ``full_rows``).
    """

    full_rows: int
    held_rows: int
    held_bits: int
    held_bytes: int
    shared_rows: bool
    num_kv_heads: int
    head_dim: int
    elem: int
    held_value_bits: int | None = None
    kept_mass: tuple[float, ...] | None = None
    span_rows: int | None = None

    @property
    def full_bytes(self) -> int:
        """K and V of the ``full_rows`` rows uncompressed."""
        return 2 * self.full_rows * self.num_kv_heads * self.head_dim * self.elem

    def choice_bytes(self, choice: JointChoice) -> int:
        """Bytes the store of ``choice`` holds (indices included; an unchanged full segment holds its K+V): a store
        whose heads share their rows names them by an int32 per row, one whose heads hold different rows by its
        :class:`~unicache_core.kv.row_index.RowIndex` (:func:`~unicache_core.kv.row_index.row_index_bytes`)."""
        h, d = self.num_kv_heads, self.head_dim
        per_head_index = not (self.shared_rows and choice.rows == self.held_rows)
        span = self.full_rows if self.span_rows is None else self.span_rows
        if not choice.quantized:
            if self.shared_rows and choice.rows == self.held_rows and self.held_bits == FULL_BITS:
                return 2 * choice.rows * h * d * self.elem  # kept as it is: no index tensor
            return 2 * choice.rows * h * d * self.elem + row_index_bytes(h, choice.rows, span)
        residual = min(choice.residual, choice.rows)
        index = row_index_bytes(h, choice.rows, span, residual) if per_head_index else 4 * choice.rows
        nbytes = quantized_kv_nbytes(
            choice.rows, h, d, choice.bits, choice.group, choice.residual, self.elem, layout=choice.layout
        )
        return nbytes + index

    def quantized(
        self, rows: int, bits: int, group: int, geometry: QuantGeometry, budget: int, value_bits: int | None = None,
        key_per_token: bool = False,
    ) -> JointChoice | None:  # fmt: skip
        """``rows`` at ``bits``/``group`` (values at ``value_bits``, ``None``: ``bits``; keys per token with
        ``key_per_token``) with the largest residual (up to the geometry's) that fits ``budget``; ``None`` when not
        even the rows without a residual fit."""
        if self.choice_bytes(JointChoice(rows, bits, group, 0, value_bits, key_per_token)) > budget:
            return None
        lo, hi = 0, geometry.residual(rows)
        while lo < hi:  # bytes grow with the residual
            mid = (lo + hi + 1) // 2
            if self.choice_bytes(JointChoice(rows, bits, group, mid, value_bits, key_per_token)) <= budget:
                lo = mid
            else:
                hi = mid - 1
        return JointChoice(rows, bits, group, lo, value_bits, key_per_token)

    def most_rows(
        self, bits: int, budget: int, geometry: QuantGeometry, max_rows: int, value_bits: int | None = None,
        key_per_token: bool = False,
    ) -> JointChoice:  # fmt: skip
        """The most rows (``<= max_rows``) that fit ``budget`` at ``bits`` (largest group: least metadata; values at
        ``value_bits``, ``None``: ``bits``; keys per token with ``key_per_token``)."""
        if bits == FULL_BITS:
            lo, hi = 0, max_rows
            while lo < hi:  # bytes grow with the rows
                mid = (lo + hi + 1) // 2
                if self.choice_bytes(JointChoice(mid)) <= budget:
                    lo = mid
                else:
                    hi = mid - 1
            return JointChoice(lo)
        group = max(geometry.groups)
        lo, hi = 0, max_rows
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.quantized(mid, bits, group, geometry, budget, value_bits, key_per_token) is not None:
                lo = mid
            else:
                hi = mid - 1
        found = self.quantized(lo, bits, group, geometry, budget, value_bits, key_per_token)
        return found if found is not None else JointChoice(0, bits, group, 0, value_bits, key_per_token)


def lookup_order(geometry: QuantGeometry) -> list[tuple[int, int]]:
    """Every (bits, group) of the geometry, most precise first (more bits, then smaller groups): the order of
    docs/compression.md §8.6's lookup, read from its top."""
    return [(bits, group) for bits in sorted(SUPPORTED_BITS, reverse=True) for group in geometry.groups]


def choose(
    segment: Segment,
    kind: str,
    budget: int,
    geometry: QuantGeometry,
    plan_bits: int | None = None,
    value_floor: int = min(SUPPORTED_BITS),
    per_token_keys: bool = False,
    evict_at_low_bits: bool = True,
) -> JointChoice:
    """The (rows, bits) of one type for ``budget`` bytes, never more rows or bits than it holds now.

    - ``evict``: the most full-precision rows that fit (the paper's H2O route), or the ``quantize`` route below
      where that loses less by :func:`choice_error`, the eviction weighed by the segment's ``kept_mass`` (its
      attention's concentration; ties keep the eviction; its residual of best-scored full-precision rows takes what
      the low-bit rows leave, up to half the rows; docs/compression.md §11.16); rows held quantized (stored so
      as they were written) keep their bits. Without ``evict_at_low_bits`` (UniCache's ``speed``) only the eviction:
      at most the rows the budget holds at full precision. A ``joint`` entry at full precision is the pure eviction;
    - ``quantize``: every row at the most precise lookup setting that fits (the paper's KIVI route); when
      even the least one does not fit, whichever keeps more rows of: a subset at the lowest bits, or
      full-precision rows; or, where it loses less by :func:`choice_error` (docs/compression.md §11.13), with
      ``per_token_keys`` and fewer rows than channels the rows with their keys grouped per token, and with
      ``value_floor`` below 2 bits the most rows with 2-bit keys and values at fewer bits;
    - ``joint``: ``plan_bits`` (the calibrated bits for this budget level) and the most rows that fit.

    A budget that covers the segment as it is held keeps it unchanged (the returned choice has its rows and
    bits); a choice is applied only when it holds fewer rows or bits (values included).
    """
    held = JointChoice(segment.held_rows, segment.held_bits, value_bits=segment.held_value_bits)
    if segment.held_bytes <= budget:
        return held
    max_rows = segment.held_rows
    allowed = [b for b in FAMILY_BITS if b <= segment.held_bits]
    held_values = held.vbits

    def values(bits: int) -> int | None:  # never more value bits than the segment holds
        return None if bits <= held_values else held_values

    if kind == "evict":
        evicted = segment.most_rows(FULL_BITS, budget, geometry, max_rows)
        if FULL_BITS in allowed and evict_at_low_bits:
            # its best-scored rows whole with the bytes every row at low bits leaves, past KIVI's 32 (MiKV's mix)
            wide = replace(geometry, residual_max=max(geometry.residual_max, max_rows))
            quantized = _quantize_route(segment, budget, wide, allowed, values, value_floor, per_token_keys)
            return quantized if choice_error(segment, quantized) < choice_error(segment, evicted) else evicted
        if FULL_BITS in allowed:
            return evicted
        # rows stored quantized as they were written: the most of them at those bits, with no residual (the
        # full-precision values a residual would hold are gone); under ``speed`` no more than full precision holds
        least, most = min(allowed), max_rows if evict_at_low_bits else evicted.rows
        return segment.most_rows(least, budget, replace(geometry, residual_max=0), most, values(least))
    if kind == "joint":
        if plan_bits is None:
            raise ValueError("a joint entry needs the bits of its budget level (`plan_bits`)")
        bits = max(b for b in allowed if b <= plan_bits) if any(b <= plan_bits for b in allowed) else min(allowed)
        if bits == FULL_BITS:
            return segment.most_rows(FULL_BITS, budget, geometry, max_rows)
        for b, group in lookup_order(geometry):  # every row fits: the smallest group that does
            if b == bits:
                found = segment.quantized(max_rows, b, group, geometry, budget, values(b))
                if found is not None:
                    return found
        return segment.most_rows(bits, budget, geometry, max_rows, values(bits))
    if kind != "quantize":
        raise ValueError(f"`kind` must be 'evict', 'quantize' or 'joint', got {kind!r}")
    return _quantize_route(segment, budget, geometry, allowed, values, value_floor, per_token_keys)


def _quantize_route(
    segment: Segment, budget: int, geometry: QuantGeometry, allowed: list[int], values: Callable[[int], int | None],
    value_floor: int, per_token_keys: bool,
) -> JointChoice:  # fmt: skip
    """:func:`choose`'s ``quantize`` route for a segment over ``budget`` (``allowed``: the bits it may take, ``values``:
    the values' bits at some key bits)."""
    max_rows = segment.held_rows
    held_values = segment.held_bits if segment.held_value_bits is None else segment.held_value_bits
    for bits, group in lookup_order(geometry):
        if bits in allowed:
            found = segment.quantized(max_rows, bits, group, geometry, budget, values(bits))
            if found is not None:
                return found
    least = min(allowed)
    best = segment.most_rows(least, budget, geometry, max_rows, values(least))
    if FULL_BITS in allowed:
        evicted = segment.most_rows(FULL_BITS, budget, geometry, max_rows)
        if evicted.rows >= best.rows:
            best = evicted
    if least == FULL_BITS:
        return best
    if per_token_keys and max_rows < segment.head_dim:  # per-token key metadata costs less than per-channel
        per_token = _per_token_keys(segment, least, [(b, g) for b, g in lookup_order(geometry) if b in allowed],
                                    budget, geometry, values)  # fmt: skip
        if per_token.rows and choice_error(segment, per_token) < choice_error(segment, best):
            best = per_token
    for value_bits in sorted((b for b in PACKED_BITS if value_floor <= b < least and b <= held_values), reverse=True):
        fewer = _fewer_value_bits(segment, least, value_bits, budget, geometry)
        if fewer.rows and choice_error(segment, fewer) < choice_error(segment, best):
            best = fewer
    return best


def _per_token_keys(
    segment: Segment, least: int, settings: list[tuple[int, int]], budget: int, geometry: QuantGeometry,
    values: Callable[[int], int | None],
) -> JointChoice:  # fmt: skip
    """Every row with its keys grouped per token at the first of ``settings`` (``(bits, group)``, most precise first)
    that fits ``budget``, else the most rows that fit at ``least`` bits; ``values(bits)``: the values' bits."""
    for bits, group in settings:
        found = segment.quantized(segment.held_rows, bits, group, geometry, budget, values(bits), key_per_token=True)
        if found is not None:
            return found
    return segment.most_rows(least, budget, geometry, segment.held_rows, values(least), key_per_token=True)


def _fewer_value_bits(
    segment: Segment, bits: int, value_bits: int, budget: int, geometry: QuantGeometry
) -> JointChoice:
    """The most rows with keys at ``bits`` and values at ``value_bits`` that fit ``budget``; when every row fits,
    the smallest key group that does (as the lookup's order)."""
    for group in geometry.groups:
        found = segment.quantized(segment.held_rows, bits, group, geometry, budget, value_bits)
        if found is not None:
            return found
    return segment.most_rows(bits, budget, geometry, segment.held_rows, value_bits)


def row_loss(bits: int) -> float:
    """The share of a row's part (its key or its value) lost at ``bits``: quantization noise power falls by 4 per bit
    (``4**-b``, 1 bit included: docs/compression.md §11.13); nothing at full precision."""
    return 0.0 if bits == FULL_BITS else 4.0**-bits


def choice_error(segment: Segment, choice: JointChoice) -> float:
    """A choice's expected share of its rows' attention output lost, the sensitivity model the allocation compares
    choices with: a kept row loses the mean of its key's and its value's :func:`row_loss` (``4**-b`` when both have
    ``b`` bits), a full precision one nothing, a dropped row all of it; each row weighs its share of the attention
    mass where the segment knows it (``kept_mass``: the best-scored rows are the ones kept), else its share of the
    rows."""
    if segment.kept_mass is not None and segment.held_rows:
        share = segment.held_rows / segment.full_rows if segment.full_rows else 1.0
        kept = share * segment.kept_mass[max(0, min(choice.rows, len(segment.kept_mass) - 1))]
    else:
        kept = min(1.0, choice.rows / segment.full_rows) if segment.full_rows else 1.0
    loss = (row_loss(choice.bits) + row_loss(choice.vbits)) / 2 if choice.quantized else 0.0
    return kept * loss + (1.0 - kept)


@functools.lru_cache(maxsize=4096)
def quantized_floor_bytes(rows: int, num_kv_heads: int, head_dim: int, elem: int, geometry: QuantGeometry) -> int:
    """The floor of a quantized segment of ``rows`` rows: the bytes of every row at the lowest bits and largest group
    without residual in a store of its own, or its uncompressed bytes when quantizing would not shrink it. Pure, so
    cached: a layer's rows per segment stay fixed once appended."""
    whole = Segment(
        full_rows=rows,
        held_rows=rows,
        held_bits=FULL_BITS,
        held_bytes=0,
        shared_rows=True,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        elem=elem,
    )
    return least_quantized_bytes(whole, geometry)


def least_quantized_bytes(segment: Segment, geometry: QuantGeometry) -> int:
    """Bytes of every row at the least lookup setting (lowest bits, largest group, no residual): the floor
    of a quantized type, or its uncompressed bytes when quantizing would not shrink it."""
    least = segment.choice_bytes(JointChoice(segment.full_rows, min(SUPPORTED_BITS), max(geometry.groups), 0))
    return min(least, segment.full_bytes)


@dataclass(frozen=True)
class JointPlan:
    """Calibrated bits per budget level of one (task, type): ``levels`` = ``((retained ratio, bits), ...)``.

    For a type budget of ratio ``r`` (its bytes over its full bytes) the bits are those of the largest level
    ``<= r`` (the smallest level's below every level).
    """

    levels: tuple[tuple[float, int], ...]

    def __post_init__(self) -> None:
        if not self.levels:
            raise ValueError("a joint plan needs at least one (budget level, bits) pair")
        levels = []
        for level, bits in self.levels:
            if (
                isinstance(level, bool)
                or not isinstance(level, (int, float))
                or not math.isfinite(level)
                or not 0.0 < level <= 1.0
            ):
                raise ValueError(f"a joint plan's budget level must be a number in (0, 1], got {level!r}")
            if bits not in FAMILY_BITS:
                raise ValueError(
                    f"a joint plan's bits must be one of {FAMILY_BITS} ({FULL_BITS} = full precision), got {bits!r}"
                )
            levels.append((float(level), int(bits)))
        if len({lv for lv, _ in levels}) != len(levels):
            raise ValueError(f"a joint plan repeats a budget level: {self.levels!r}")
        object.__setattr__(self, "levels", tuple(sorted(levels, reverse=True)))

    def bits_for(self, ratio: float) -> int:
        for level, bits in self.levels:
            if level <= ratio + 1e-12:
                return bits
        return self.levels[-1][1]

    def to_list(self) -> list[dict]:
        return [{"budget": level, "bits": bits} for level, bits in self.levels]

    @classmethod
    def from_list(cls, rows: Sequence) -> JointPlan:
        if not isinstance(rows, (list, tuple)):
            raise ValueError(f"a joint plan must be a list of {{budget, bits}} objects, got {rows!r}")
        pairs = []
        for row in rows:
            if not isinstance(row, Mapping) or set(row) != {"budget", "bits"}:
                raise ValueError(f'a joint plan row must be {{"budget": r, "bits": b}}, got {row!r}')
            pairs.append((row["budget"], row["bits"]))
        return cls(tuple(pairs))


def grid_choices(
    segment: Segment, geometry: QuantGeometry, levels: Sequence[float] = JOINT_LEVELS, bits: Sequence[int] = JOINT_BITS
) -> dict[tuple[float, int], JointChoice]:
    """The offline sensitivity grid of one type (docs/compression.md §11.4): at each budget level, for each bit
    width, the most rows that fit ``level`` of the type's full bytes (matched bytes across the bit widths).

    Returns ``{(level, bits): choice}``; a bit width that keeps no row at a level is left out.
    """
    grid = {}
    for level in levels:
        budget = int(math.floor(level * segment.full_bytes))
        for b in bits:
            choice = segment.most_rows(b, budget, geometry, segment.held_rows)
            if choice.rows > 0:
                grid[(float(level), int(b))] = choice
    return grid


def plan_from_errors(errors: Mapping[tuple[float, int], float]) -> JointPlan:
    """Per budget level, the bit width whose measured output error is least (ties: the more rows, i.e. fewer
    bits). ``errors``: ``{(level, bits): error}`` of the grid points that were measured."""
    if not errors:
        raise ValueError("no sensitivity was measured: the grid is empty")
    best: dict[float, tuple[float, int]] = {}
    for (level, b), err in errors.items():
        if not math.isfinite(err):
            raise ValueError(f"the error measured at level {level}, {b} bits is {err!r}")
        if level not in best or (err, b) < best[level]:
            best[level] = (err, b)
    return JointPlan(tuple((level, b) for level, (_, b) in best.items()))


__all__ = [
    "FAMILY_BITS",
    "FULL_BITS",
    "JointChoice",
    "JointPlan",
    "choice_error",
    "QuantGeometry",
    "Segment",
    "choose",
    "grid_choices",
    "least_quantized_bytes",
    "lookup_order",
    "plan_from_errors",
    "row_loss",
]
