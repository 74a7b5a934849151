"""The memory target of a compressing request: a retained ratio of the full compressible KV, or a byte count."""

from __future__ import annotations

import math
import re
from typing import Any

_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmg]i?b|b)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_kv_target(value: Any) -> float | int | None:
    """A retained ratio ``(0, 1]`` of the full managed KV bytes (float) or a byte count (int > 1).

    Strings: ``"0.2"``, ``"20%"``, ``"150MB"``, ``"64MiB"``, ``"123456"`` (bytes). ``None`` stays ``None``.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"`kv_target` must be a ratio in (0, 1] or a byte count, got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        if text.endswith("%"):
            try:
                percent = float(text[:-1])
            except ValueError:
                raise ValueError(f"`kv_target` {value!r} is not a percentage like '20%'") from None
            if not math.isfinite(percent) or not 0.0 < percent <= 100.0:
                raise ValueError(
                    f"`kv_target` {value!r} is outside (0%, 100%]; give the share of the KV to keep, "
                    f"e.g. 20% (5x less KV)"
                )
            return percent / 100.0
        match = _SIZE.match(text)
        if not match:
            raise ValueError(f"`kv_target` {value!r} is neither a ratio (0.2, 20%) nor a size (150MB, 64MiB, 123456)")
        number, unit = float(match.group(1)), (match.group(2) or "").lower()
        if unit:  # a size is always a byte count, even when it comes out as 1
            size = int(number * _UNITS[unit])
            if size <= 1:
                raise ValueError(
                    f"`kv_target` {value!r} is {size} byte(s), which holds no KV; give a size of at "
                    f"least one KV row (e.g. 150MB) or a ratio (0.2, 20%)"
                )
            return size
        return parse_kv_target(number if "." in match.group(1) else int(match.group(1)))
    if isinstance(value, int):
        if value == 1:
            return 1.0
        if value < 1:
            raise ValueError(f"`kv_target` must be a ratio in (0, 1] or a byte count > 1, got {value!r}")
        return value
    if isinstance(value, float):
        if not math.isfinite(value) or not 0.0 < value <= 1.0:
            raise ValueError(f"`kv_target` ratio must be in (0, 1] (e.g. 0.2 = keep 20%, 5x less KV), got {value!r}")
        return value
    raise ValueError(f"`kv_target` must be a ratio in (0, 1] or a byte count, got {type(value).__name__}")


__all__ = ["parse_kv_target"]
