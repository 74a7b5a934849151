"""Memory sizes written by people (``24GB``, ``12 GiB``, ``1.5e10``): the one parser of every flag, widget and
setting that takes a size (``--device-memory``, ``--kv-target 150MB``).

A size is a number, optionally with an exponent, and a unit: none or ``B`` (bytes), ``kB``/``MB``/``GB``/``TB``
(powers of 1000) or ``KiB``/``MiB``/``GiB``/``TiB`` (powers of 1024), case-insensitive, spaces allowed around. The
number is read exactly (as a decimal, never a float), so ``1e400GB`` is a number far above the largest size accepted,
named as such, rather than an infinity or an overflow; ``inf`` and ``nan`` are no numbers. Every caller gives the
range it accepts; the default bounds are :data:`MIN_BYTES` and :data:`MAX_BYTES`.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

#: Bytes per unit (lower-case names).
UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
#: The largest size any setting accepts: 1 PiB, beyond every device and every KV cache this runs on.
MAX_BYTES = 2**50
#: The smallest: one byte.
MIN_BYTES = 1
#: Characters of a size string looked at (a longer one is no size anyone meant).
MAX_TEXT = 64

_SIZE = re.compile(r"\s*((?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*")


def split_size(text: str) -> tuple[Decimal, str] | None:
    """``(number, unit)`` of a size string (the unit lower-cased, ``""`` when none), or ``None`` when ``text`` is
    not one (an unknown unit included)."""
    if len(text) > MAX_TEXT:
        return None
    match = _SIZE.fullmatch(text)
    if match is None or match.group(2).lower() not in UNITS:
        return None
    try:
        return Decimal(match.group(1)), match.group(2).lower()
    except InvalidOperation:  # pragma: no cover - the pattern admits only decimal numbers
        return None


def describe_bytes(count: int) -> str:
    """``count`` bytes for a message: ``"1125899906842624 bytes (1 PiB)"`` style, the unit that reads best."""
    for unit, size in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count} bytes ({count / size:g} {unit})"
    return f"{count} bytes"


def parse_size(
    value: object,
    what: str,
    *,
    minimum: int = MIN_BYTES,
    maximum: int = MAX_BYTES,
    example: str = "24GB",
) -> int:
    """A size in bytes, in ``[minimum, maximum]``.

    Args:
        value: a size string (module docstring), or an ``int`` byte count.
        what: the flag or setting, named first in every error (``"--device-memory"``).
        minimum, maximum: the accepted range in bytes.
        example: a size to suggest.

    Raises:
        ValueError: one line naming ``what``, the value, the accepted range or form, and an example.
    """
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"{what}: {value!r} is not a memory size; write e.g. {example}, 12GiB or 8e9")
    if isinstance(value, int):
        number, unit = Decimal(value), ""
    else:
        parsed = split_size(value)
        if parsed is None:
            shown = value if len(value) <= MAX_TEXT else value[:MAX_TEXT] + "..."
            raise ValueError(
                f"{what}: {shown!r} is not a memory size; write a number with kB, MB, GB, TB, KiB, MiB, GiB or TiB "
                f"(or none for bytes), e.g. {example}, 12GiB or 8e9"
            )
        number, unit = parsed
    if number.adjusted() >= 40:  # 1e999999: beyond any maximum, decided before any arithmetic on it
        size = Decimal(maximum) + 1
    elif number.adjusted() <= -40:
        size = Decimal(0)
    else:
        size = number * UNITS[unit]
    if size > maximum:
        raise ValueError(
            f"{what}: {value!r} is more than the largest size accepted, {describe_bytes(maximum)}; give a real "
            f"size, e.g. {example}"
        )
    if size < minimum:
        raise ValueError(
            f"{what}: {value!r} is less than the smallest size accepted, {describe_bytes(minimum)}; give a real "
            f"size, e.g. {example}"
        )
    return int(size)


__all__ = ["MAX_BYTES", "MIN_BYTES", "UNITS", "describe_bytes", "parse_size", "split_size"]
