"""The checks every setting of the library goes through, in one place: integers, numbers, ratios and flags.

Each returns the value (as a plain Python ``int``/``float``/``bool``) or raises one ``ValueError`` that names the
setting, the bound and the value given. numpy integers and floats are accepted as their Python kinds; booleans are
never numbers here.
"""

from __future__ import annotations

import math
import numbers

import numpy as np


def is_integer(value: object) -> bool:
    """An integer of any kind (Python or numpy), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def is_real(value: object) -> bool:
    """A finite real number of any kind (Python or numpy), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)) and math.isfinite(value)


def check_int(name: str, value: object, minimum: int, maximum: int | None = None) -> int:
    """``int(value)`` when it is an integer in ``[minimum, maximum]``, else a ValueError naming ``name``."""
    if not is_integer(value) or value < minimum or (maximum is not None and value > maximum):  # type: ignore[operator]
        bound = f">= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
        raise ValueError(f"`{name}` must be an integer {bound}, got {value!r}")
    return int(value)  # type: ignore[call-overload]


def check_float(
    name: str, value: object, minimum: float, *, strict: bool = False, maximum: float | None = None
) -> float:
    """``float(value)`` when it is a finite real number ``>= minimum`` (``>`` with ``strict``) and ``<= maximum``."""
    ok = is_real(value)
    if ok:
        ok = value > minimum if strict else value >= minimum  # type: ignore[operator]
        ok = ok and (maximum is None or value <= maximum)  # type: ignore[operator]
    if not ok:
        bound = f"> {minimum}" if strict else f">= {minimum}"
        if maximum is not None:
            bound += f" and <= {maximum}"
        raise ValueError(f"`{name}` must be a finite number {bound}, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def check_ratio(name: str, value: object, *, allow_zero: bool = False, allow_one: bool = True) -> float:
    """``float(value)`` when it is a number in (0, 1] (0 included with ``allow_zero``, 1 left out without
    ``allow_one``)."""
    ok = is_real(value) and (0.0 <= value if allow_zero else 0.0 < value)  # type: ignore[operator]
    ok = ok and (value <= 1.0 if allow_one else value < 1.0)  # type: ignore[operator]
    if not ok:
        interval = ("[0" if allow_zero else "(0") + (", 1]" if allow_one else ", 1)")
        raise ValueError(f"`{name}` must be a number in {interval}, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def check_bool(name: str, value: object) -> bool:
    """``value`` when it is True or False."""
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be True or False, got {value!r}")
    return value


__all__ = ["check_bool", "check_float", "check_int", "check_ratio", "is_integer", "is_real"]
