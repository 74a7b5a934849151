"""The sensitivity grid (docs/compression.md §11.4): each candidate type alone at every budget level x bit width
at matched bytes; the least mean change per level becomes the type's ``joint`` plan."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ...compression.defaults import JOINT_BITS, JOINT_LEVELS
from ...compression.family import JointPlan, plan_from_errors
from ...kv.token_types import TokenType
from .options import CalibrationOptions
from .sensitivity import single_type_table, type_alone


def joint_grid(
    loaded,
    task: str,
    inputs: Sequence[tuple[str, object]],
    references: Sequence,
    types: Sequence[str],
    model_id: str,
    options: CalibrationOptions,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """The grid of every type in ``types`` (names), each alone, against the full-KV ``references``.

    Returns ``{"grid": measurements, "plans": {type name: JointPlan}}``; the measurements keep every point's
    mean change and the bytes the type held (``type_retained``).
    """
    out: dict = {
        "levels": list(JOINT_LEVELS),
        "bits": list(JOINT_BITS),
        "metric": "1 - token agreement" if task == "understanding" else "latent relative L2",
        "reference": "the calibration run (full KV)",
        "types": {},
    }
    plans: dict[str, JointPlan] = {}
    for name in types:
        ttype = TokenType.parse(name)
        errors: dict[tuple[float, int], float] = {}
        points = []
        for level in JOINT_LEVELS:
            for bits in JOINT_BITS:
                # A one-level plan gives these bits at any budget; rho fixed at the level sets the budget.
                table = single_type_table(task, ttype, "joint", model_id, JointPlan(((1.0, bits),)))
                measured = type_alone(loaded, task, ttype, table, level, inputs, references, options)
                change = errors[(level, bits)] = measured["change"]
                points.append(
                    {
                        "budget": level,
                        "bits": bits,
                        "change": round(change, 8),
                        "type_retained": measured["type_retained"],
                    }
                )
                if progress is not None:
                    progress(f"grid {name} level {level} bits {bits}: change {change:.4g}")
        plans[name] = plan_from_errors(errors)
        out["types"][name] = {"points": points, "plan": plans[name].to_list()}
    return {"grid": out, "plans": plans}


__all__ = ["joint_grid"]
