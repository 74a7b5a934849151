"""Offline K90 calibration of a UniCache policy table (docs/compression.md §8.4-§8.5; issue C2).

Command line::

    python -m unicache_core.bagel.calibrate --checkpoint DIR --task {und,t2i,edit} --prompts FILE [--images DIR]
        --out policy.json [--sensitivity] [--grid] [--steps N] [--max-new-tokens N] [--dtype fp32|bf16] [--size PX]

Defaults: ``--steps 50`` (``num_timesteps``, as in ``python -m unicache_core.bagel``: 49 denoising steps),
``--max-new-tokens 64``, ``--size 512`` (the paper's resolution), ``--dtype bf16``, ``--seed 0``,
``--device auto``. ``--merge`` keeps the other tasks of an existing ``--out`` table; ``-v`` logs progress.

Procedure:

1. Every prompt (one per line of ``--prompts``, UTF-8, blank lines skipped) runs at full KV through
   :class:`~unicache_core.compression.calibration.CalibrationCacheFactory`, which scores every call where the
   cache is read (denoising steps of every CFG branch; understanding: the prompt prefill and every
   decoded token) on all layers, with 256 scored queries per call, and records, per (branch, layer,
   step, candidate type), the K90 of the type's per-key attention mass and the type's mass. Edit / understanding prompts are paired with the
   sorted images of ``--images`` round-robin; without ``--images`` they get deterministic synthetic
   images (coloured rectangles, ``--size`` px), and ``measurements`` says so.
2. Records are grouped with §8.5's chunking, per (type, layer chunk, step chunk) — understanding's
   prefill observation is its own step chunk ``"prefill"`` — and averaged per prompt inside each cell
   (over the cell's layers, steps and branches). The table's K90 of a (task, type) is the median of
   those per-(prompt, cell) values, routed with the 0.3 threshold
   (:meth:`~unicache_core.compression.routing.PolicyTable.from_k90`). ``measurements`` keeps, per cell,
   the median over prompts of the K90 and the mean mass, plus the per-branch medians.
3. ``--sensitivity``: for each candidate type present, every prompt runs again with only that type
   compressed, once evicted (H2O scores, 25% recent) and once quantized (the KIVI lookup row whose real
   bytes fit), at the task's target retention (0.2 understanding / edit, 0.4 t2i) — a UniCache run whose
   table protects the other types and whose rho is fixed at the ratio. The change against the
   calibration run (itself full KV) is the latent relative L2 (and 1 - cosine) for t2i / edit, and
   1 - token agreement for understanding. ``sensitivity_agrees[type]`` is True when the policy with
   the smaller change is the K90 choice; ``None`` on an exact tie or when the comparison is not at
   matched memory (``comparable`` False: a policy held the type above the ratio, e.g. a segment
   shorter than KIVI's 32-row residual cannot be quantized).

4. ``--grid``: the sensitivity grid of docs/compression.md §11.4. For each candidate type present, every prompt
   runs again with only that type compressed at each budget level (0.5, 0.25, 0.12, 0.06 of its bytes) x
   bits (full precision, 8, 4, 2), each bit width keeping the most rows that fit the level (matched
   bytes); the change is measured as for ``--sensitivity``. Per level the bit width with the least mean
   change wins (ties: fewer bits, more rows), and the type's entry becomes ``joint`` with that plan
   (``plan: [{"budget": level, "bits": b}, ...]``); ``measurements["grid"]`` keeps every point's change
   and the bytes the type held. The table also records the quantization geometry the grid used.

The table holds the calibrated entries of this task; the other (task, type) pairs keep the entries of
the ``--out`` table with ``--merge`` (a table of the same model; run once per task to build a full
table), else the paper's assignment (listed in ``measurements["filled"]``), so the file can be used
as ``<checkpoint>/unicache_policy.json`` for every task. Progress is silent; one summary line goes to
stderr. Errors are one line (``error: ...``), exit status 2; Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..errors import UniCacheError
from ..kv.cache import CacheFactory
from ..kv.token_types import CANDIDATE_TYPES, TokenType
from ..compression.defaults import DEFAULT_K90_THRESHOLD, DEFAULT_REDUCTION, JOINT_BITS, JOINT_LEVELS, SCORE_QUERIES
from ..compression.family import JointPlan, plan_from_errors
from ..compression.policy_table import PolicyTable, PolicyTableError
from ..compression.stats import layer_chunk, step_chunk
from ..cli import OneLineParser as _Parser, path_arg as _path
from .settings import preset

logger = logging.getLogger("unicache_core.bagel.calibrate")

#: ``--task`` value → pipeline task name.
TASK_NAMES = {"und": "understanding", "t2i": "t2i", "edit": "edit"}
#: Target retention of the sensitivity ablation (docs/compression.md §8.9: 80% reduction und/edit, 60% t2i).
SENSITIVITY_RATIO = {task: round(1.0 - reduction, 6) for task, reduction in DEFAULT_REDUCTION.items()}
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
MAX_PROMPTS_FILE_BYTES = 16 << 20
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DEFAULTS = {"steps": 50, "max_new_tokens": 64, "dtype": "bf16", "size": 512, "seed": 0, "score_queries": SCORE_QUERIES}


# ------------------------------------------------------------------------------------------- inputs


def read_prompts(path: Path) -> list[str]:
    """One prompt per line (strict UTF-8, BOM dropped, surrounding whitespace stripped, blank lines skipped)."""
    if path.is_dir():
        raise ValueError(f"--prompts: {path} is a directory; pass a UTF-8 text file with one prompt per line")
    if not path.exists():
        raise FileNotFoundError(f"--prompts: file not found: {path}")
    if not path.is_file():
        raise ValueError(f"--prompts: {path} is not a regular file; pass a UTF-8 text file")
    size = path.stat().st_size
    if size > MAX_PROMPTS_FILE_BYTES:
        raise ValueError(f"--prompts: {path} is {size} bytes; at most {MAX_PROMPTS_FILE_BYTES} bytes are read")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"--prompts: {path} is not valid UTF-8 (byte 0x{data[exc.start]:02x} at offset "
                         f"{exc.start}); save it as UTF-8") from None
    return [p for _, p in _numbered(path, text)]


def _numbered(path: Path, text: str) -> list[tuple[int, str]]:
    lines = [(i + 1, line.strip()) for i, line in enumerate(text.removeprefix("\ufeff").splitlines())]
    lines = [(n, p) for n, p in lines if p]
    if not lines:
        raise ValueError(f"--prompts: {path} holds no prompt (every line is blank); write one prompt per line")
    return lines


def prompt_line_numbers(path: Path) -> list[int]:
    """File line number of each prompt :func:`read_prompts` returns (for error messages)."""
    return [n for n, _ in _numbered(path, path.read_bytes().decode("utf-8"))]


def read_images(folder: Path) -> list[tuple[str, object]]:
    """``[(file name, PIL image)]`` of the image files of ``folder`` (not recursive), sorted by name."""
    from .cli_checks import open_image

    if not folder.exists():
        raise FileNotFoundError(f"--images: folder not found: {folder}")
    if not folder.is_dir():
        raise ValueError(f"--images: {folder} is not a folder; pass a folder of images")
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise ValueError(f"--images: {folder} holds no image file ({', '.join(IMAGE_SUFFIXES)})")
    out = []
    for path in files:
        try:
            out.append((path.name, open_image(path)))
        except ValueError as exc:
            raise ValueError(str(exc).replace("--image:", "--images:", 1)) from None
    return out


#: Colours of the synthetic images (background, rectangle) — fixed, so calibration runs are reproducible.
_PALETTE = ((200, 40, 40), (40, 160, 60), (40, 70, 200), (230, 200, 40), (150, 60, 170), (30, 170, 180),
            (240, 130, 30), (120, 120, 120))


def synthetic_image(index: int, size: int):
    """A deterministic ``size x (3/4 size)`` RGB image: a coloured background with a rectangle of another colour."""
    from PIL import Image, ImageDraw

    width, height = size, max(16, (size * 3 // 4) // 16 * 16)
    bg = _PALETTE[index % len(_PALETTE)]
    fg = _PALETTE[(index * 3 + 1) % len(_PALETTE)]
    if fg == bg:
        fg = tuple(255 - c for c in bg)
    image = Image.new("RGB", (width, height), bg)
    draw = ImageDraw.Draw(image)
    fx, fy = ((index * 37) % 50) / 100.0, ((index * 61) % 50) / 100.0  # top-left corner in [0, 0.5)
    x0, y0 = int(fx * width), int(fy * height)
    draw.rectangle([x0, y0, x0 + width // 2 - 1, y0 + height // 2 - 1], fill=fg)
    return image


# ------------------------------------------------------------------------------------------- runs


def _run_one(pipe, task: str, prompt: str, image, *, num_timesteps: int, max_new_tokens: int, size: int,
             seed: int):
    if task == "t2i":
        return pipe.text_to_image(prompt, preset("t2i", width=size, height=size, num_timesteps=num_timesteps),
                                  seed=seed)
    if task == "edit":
        return pipe.edit(prompt, image, preset("edit", num_timesteps=num_timesteps), seed=seed)
    return pipe.understand(prompt, image, preset("understanding", max_new_tokens=max_new_tokens), seed=seed)


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def aggregate(records_per_prompt: Sequence[Sequence[Sequence]]) -> dict:
    """Group the calibration records (§8.5 chunks) per (type, layer chunk, step chunk).

    Args:
        records_per_prompt: per prompt, the records ``[branch, layer, step, type, k90, mass]`` of
            :class:`~unicache_core.compression.calibration.CalibrationSession` (``step`` None = prefill).

    Returns:
        ``{"k90s": {type: [per-(prompt, cell) mean K90]}, "cells": [...], "per_branch": {...}, "mass": {...}}``.
    """
    per_prompt_cells: dict[tuple, list[tuple[list[float], list[float]]]] = {}
    branch_k90: dict[str, dict[str, list[float]]] = {}
    for records in records_per_prompt:
        cells: dict[tuple, tuple[list[float], list[float]]] = {}
        for branch, layer, step, ttype, k, mass in records:
            s = "prefill" if step is None else step_chunk(int(step))
            key = (ttype, layer_chunk(int(layer)), s)
            ks, ms = cells.setdefault(key, ([], []))
            ks.append(float(k))
            ms.append(float(mass))
            branch_k90.setdefault(ttype, {}).setdefault(branch, []).append(float(k))
        for key, (ks, ms) in cells.items():
            per_prompt_cells.setdefault(key, []).append((ks, ms))
    k90s: dict[str, list[float]] = {}
    masses: dict[str, list[float]] = {}
    rows = []

    def order(key):
        ttype, c, s = key
        return (int(TokenType.parse(ttype)), c, -1 if s == "prefill" else s)

    for key in sorted(per_prompt_cells, key=order):
        ttype, c, s = key
        cell_k90 = [statistics.fmean(ks) for ks, _ in per_prompt_cells[key]]
        cell_mass = [statistics.fmean(ms) for _, ms in per_prompt_cells[key]]
        k90s.setdefault(ttype, []).extend(cell_k90)
        masses.setdefault(ttype, []).extend(cell_mass)
        rows.append({"type": ttype, "layer_chunk": c, "step_chunk": s, "k90": round(_median(cell_k90), 6),
                     "mass": round(statistics.fmean(cell_mass), 6), "prompts": len(cell_k90),
                     "samples": sum(len(ks) for ks, _ in per_prompt_cells[key])})
    per_branch = {t: {b: round(_median(v), 6) for b, v in sorted(by.items())} for t, by in branch_k90.items()}
    return {"k90s": k90s, "cells": rows, "per_branch": per_branch,
            "mass": {t: round(statistics.fmean(v), 6) for t, v in masses.items()}}


def _change(task: str, result, reference) -> dict:
    """Output change of a compressed run against the full-KV reference."""
    if task == "understanding":
        a, b = list(result.token_ids), list(reference.token_ids)
        n = max(len(a), len(b))
        agree = 1.0 if n == 0 else sum(1 for x, y in zip(a, b) if x == y) / n
        return {"token_agreement": agree, "change": 1.0 - agree}
    x, ref = result.latents.double().flatten(), reference.latents.double().flatten()
    denom = float(ref.norm())
    rel = float((x - ref).norm()) / denom if denom > 0 else float((x - ref).norm())
    cos = float(torch.nn.functional.cosine_similarity(x, ref, dim=0))
    return {"latent_rel_l2": rel, "one_minus_cosine": max(0.0, 1.0 - cos), "change": rel}


def single_type_table(task: str, ttype: TokenType, kind: str, model_id: str,
                      plan: JointPlan | None = None) -> PolicyTable:
    """A table that applies ``kind`` to ``ttype`` in ``task`` and protects every other candidate type (``plan``:
    the bits of a ``joint`` kind)."""
    entries = {(task, t): (kind if t == ttype else "protect") for t in CANDIDATE_TYPES}
    return PolicyTable(entries=entries, model_id=model_id, source="calibrated",
                       plans={} if plan is None else {(task, ttype): plan},
                       measurements={"purpose": f"sensitivity: {kind} {ttype.name.lower()} only"})


class _KeepSession(CacheFactory):
    """Wraps a cache factory and keeps the last session it started (to measure what a run held)."""

    def __init__(self, inner: CacheFactory):
        self.inner = inner
        self.method = inner.method
        self.last = None

    def start(self, request):
        self.last = self.inner.start(request)
        return self.last


def type_retained(session, ttype: TokenType) -> float | None:
    """Bytes the live branch caches hold for ``ttype`` over its uncompressed bytes (``None`` if absent)."""
    held = full = 0
    for cache in session.live_caches():
        if cache.branch == "plan":
            continue
        for layer in range(cache.num_layers):
            held += sum(s.nbytes() for s in cache.layer(layer).stores if s.token_type == ttype)
            full += cache.type_rows(layer).get(ttype, 0) * cache.row_bytes(layer)
    return None if full == 0 else held / full


def sensitivity(loaded, task: str, inputs: Sequence[tuple[str, object]], references: Sequence, types: Sequence[str],
                k90_choice: dict[str, str], model_id: str, run_kwargs: dict,
                progress: Callable[[str], None] | None = None) -> dict:
    """The single-type ablation of §8.4 (see the module docstring); returns the ``sensitivity`` measurements.

    A comparison counts (``comparable``) only when both policies held the type at or under the target
    ratio; otherwise (e.g. a segment shorter than KIVI's 32-row residual cannot be quantized) ``agrees``
    is ``None``.
    """
    from .pipeline import BagelPipeline
    from ..compression import KVConfig, make_cache_factory

    ratio = SENSITIVITY_RATIO[task]
    out: dict = {"ratio": ratio, "metric": "1 - token agreement" if task == "understanding" else "latent relative L2",
                 "reference": "the calibration run (full KV)", "types": {}}
    agrees: dict[str, bool | None] = {}
    for name in types:
        ttype = TokenType.parse(name)
        entry: dict = {}
        for kind in ("evict", "quantize"):
            table = single_type_table(task, ttype, kind, model_id)
            keep = _KeepSession(make_cache_factory(KVConfig(method="unicache", rho=ratio, rho_floor=ratio,
                                                            policy=table)))
            pipe = BagelPipeline(loaded, keep)
            changes, flags, retained = [], {}, []
            for (prompt, image), ref in zip(inputs, references):
                res = _run_one(pipe, task, prompt, image, **run_kwargs)
                changes.append(_change(task, res, ref))
                flags.update(((res.kv_report or {}).get("summary") or {}).get("flags") or {})
                r = type_retained(keep.last, ttype)
                if r is not None:
                    retained.append(r)
                keep.last = None
            metrics = {k: [round(c[k], 8) for c in changes] for k in changes[0] if k != "change"}
            entry[kind] = {"change": statistics.fmean(c["change"] for c in changes), "per_prompt": metrics,
                           "type_retained": None if not retained else round(max(retained), 6), "flags": flags}
            if progress is not None:
                progress(f"sensitivity {name} {kind}: change {entry[kind]['change']:.4g}, "
                         f"retained {entry[kind]['type_retained']}")
        ev, qu = entry["evict"]["change"], entry["quantize"]["change"]
        comparable = all(entry[k]["type_retained"] is not None and entry[k]["type_retained"] <= ratio * (1 + 1e-6)
                         for k in ("evict", "quantize"))
        preferred = None if ev == qu else ("evict" if ev < qu else "quantize")
        entry["comparable"] = comparable
        entry["preferred"] = preferred
        entry["k90_choice"] = k90_choice[name]
        entry["agrees"] = None if preferred is None or not comparable else preferred == k90_choice[name]
        agrees[name] = entry["agrees"]
        out["types"][name] = entry
    out["note"] = ("'type_retained': the most bytes of the type held after a run (over the live branches) as a share "
                   "of its uncompressed bytes; a comparison counts ('comparable') only when both policies are at or "
                   "under 'ratio'; 'flags': budgets a quantized segment could not reach even at 2-bit/G128 with "
                   "the 32-row residual")
    return {"sensitivity": out, "sensitivity_agrees": agrees}


def joint_grid(loaded, task: str, inputs: Sequence[tuple[str, object]], references: Sequence, types: Sequence[str],
               model_id: str, run_kwargs: dict, progress: Callable[[str], None] | None = None) -> dict:
    """The sensitivity grid of docs/compression.md §11.4 (see the module docstring).

    Returns ``{"grid": measurements, "plans": {type: JointPlan}}``: each type alone at every (budget level,
    bits), the rest protected, a UniCache run whose rho is fixed at the level and whose one-level plan gives
    the bits at any budget.
    """
    from .pipeline import BagelPipeline
    from ..compression import KVConfig, make_cache_factory

    out: dict = {"levels": list(JOINT_LEVELS), "bits": list(JOINT_BITS),
                 "metric": "1 - token agreement" if task == "understanding" else "latent relative L2",
                 "reference": "the calibration run (full KV)", "types": {}}
    plans: dict[str, JointPlan] = {}
    for name in types:
        ttype = TokenType.parse(name)
        errors: dict[tuple[float, int], float] = {}
        points = []
        for level in JOINT_LEVELS:
            for bits in JOINT_BITS:
                table = single_type_table(task, ttype, "joint", model_id, JointPlan(((1.0, bits),)))
                keep = _KeepSession(make_cache_factory(KVConfig(method="unicache", rho=level, rho_floor=level,
                                                                policy=table)))
                pipe = BagelPipeline(loaded, keep)
                changes, retained = [], []
                for (prompt, image), ref in zip(inputs, references):
                    changes.append(_change(task, _run_one(pipe, task, prompt, image, **run_kwargs), ref)["change"])
                    r = type_retained(keep.last, ttype)
                    if r is not None:
                        retained.append(r)
                    keep.last = None
                errors[(level, bits)] = statistics.fmean(changes)
                points.append({"budget": level, "bits": bits, "change": round(errors[(level, bits)], 8),
                               "type_retained": None if not retained else round(max(retained), 6)})
                if progress is not None:
                    progress(f"grid {name} level {level} bits {bits}: change {errors[(level, bits)]:.4g}")
        plans[name] = plan_from_errors(errors)
        out["types"][name] = {"points": points, "plan": plans[name].to_list()}
    return {"grid": out, "plans": plans}


def calibrate(loaded, task: str, prompts: Sequence[str], images: Sequence[tuple[str, object]] | None = None, *,
              num_timesteps: int = DEFAULTS["steps"], max_new_tokens: int = DEFAULTS["max_new_tokens"],
              size: int = DEFAULTS["size"], seed: int = DEFAULTS["seed"], run_sensitivity: bool = False,
              run_grid: bool = False, score_queries: int = DEFAULTS["score_queries"],
              threshold: float = DEFAULT_K90_THRESHOLD,
              arguments: dict | None = None, progress: Callable[[str], None] | None = None) -> PolicyTable:
    """Calibrate ``task`` (``understanding``, ``t2i`` or ``edit``) on a loaded model; returns the task's table.

    ``images``: ``[(name, PIL image)]`` paired with the prompts round-robin (edit / understanding); ``None``
    = synthetic images. The returned table holds only this task's measured entries (see :func:`finish_table`).
    """
    from .pipeline import BagelPipeline
    from ..compression.calibration import CalibrationCacheFactory
    from .checkpoint.model_id import model_id_of

    if task not in SENSITIVITY_RATIO:
        raise ValueError(f"`task` must be one of {tuple(SENSITIVITY_RATIO)}, got {task!r}")
    if not prompts:
        raise ValueError("`prompts` is empty")
    model_id = model_id_of(loaded.checkpoint_dir)
    inputs: list[tuple[str, object]] = []
    image_names: list[str | None] = []
    for i, prompt in enumerate(prompts):
        if task == "t2i":
            inputs.append((prompt, None))
            image_names.append(None)
        elif images:
            name, image = images[i % len(images)]
            inputs.append((prompt, image))
            image_names.append(name)
        else:
            inputs.append((prompt, synthetic_image(i, size)))
            image_names.append(f"synthetic-{i}")
    run_kwargs = dict(num_timesteps=num_timesteps, max_new_tokens=max_new_tokens, size=size, seed=seed)
    pipe = BagelPipeline(loaded, CalibrationCacheFactory(score_queries))
    start = time.perf_counter()
    references, records = [], []
    for i, (prompt, image) in enumerate(inputs):
        res = _run_one(pipe, task, prompt, image, **run_kwargs)
        references.append(res)
        records.append(res.kv_report["calibration"]["records"])
        if progress is not None:
            progress(f"prompt {i + 1}/{len(inputs)}: {len(records[-1])} records")
    agg = aggregate(records)
    if not agg["k90s"]:
        raise ValueError(f"no candidate KV was read in any {task} run (no instruction / source image tokens)")
    measured = {t: _median(v) for t, v in agg["k90s"].items()}
    table = PolicyTable.from_k90({(task, t): v for t, v in agg["k90s"].items()}, threshold, model_id)
    choice = {t: table.kind(task, t) for t in measured}
    decode_steps = [len(r.token_ids) for r in references] if task == "understanding" else None
    m: dict = {
        "arguments": dict(arguments or {}),
        "prompts": len(prompts),
        "steps": None if task == "understanding" else num_timesteps - 1,
        "num_timesteps": None if task == "understanding" else num_timesteps,
        "max_new_tokens": max_new_tokens if task == "understanding" else None,
        "decoded_tokens": decode_steps,
        "size": size if task == "t2i" or not images else None,
        "seed": seed,
        "score_queries": score_queries,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "layers": loaded.model.num_layers,
        "images": ("none (t2i)" if task == "t2i" else
                   "synthetic: deterministic coloured rectangles generated by unicache_core.bagel.calibrate "
                   f"({size} px wide), not real images" if not images else
                   f"{len(images)} image(s) from --images, paired with the prompts round-robin"),
        "image_names": None if task == "t2i" else image_names,
        "aggregation": ("records per (branch, layer, step, type) -> mean per prompt within each (type, layer "
                        "chunk, step chunk) cell (docs/compression.md §8.5; understanding's prefill observation is "
                        "step chunk 'prefill') -> median over prompts and cells per type; cell 'k90' = median over "
                        "prompts, 'mass' = mean share of the full resident softmax"),
        "k90": {t: round(v, 6) for t, v in measured.items()},
        "mass": agg["mass"],
        "choice": choice,
        "k90_per_branch": agg["per_branch"],
        "cells": agg["cells"],
        "seconds": None,
    }
    if run_sensitivity:
        m.update(sensitivity(loaded, task, inputs, references, list(measured), choice, model_id, run_kwargs,
                             progress))
    entries, plans = dict(table.entries), {}
    if run_grid:
        grid = joint_grid(loaded, task, inputs, references, list(measured), model_id, run_kwargs, progress)
        m["grid"] = grid["grid"]
        for name, plan in grid["plans"].items():
            entries[(task, TokenType.parse(name))] = "joint"
            plans[(task, TokenType.parse(name))] = plan
        m["choice"] = {t: entries[(task, TokenType.parse(t))] for t in measured}
    m["seconds"] = round(time.perf_counter() - start, 3)
    return PolicyTable(entries=entries, threshold=threshold, k90=table.k90, model_id=model_id, plans=plans,
                       source="calibrated", measurements={"tool": "python -m unicache_core.bagel.calibrate",
                                                          "tasks": {task: m}})


def finish_table(table: PolicyTable, task: str, base: PolicyTable | None = None) -> PolicyTable:
    """``table`` (this task's measured entries) completed with every other (task, type) pair.

    Pairs come from ``base`` (a ``--merge`` table of the same model) where it has them, else from the paper's
    assignment; ``measurements["filled"]`` names each pair that was not measured in this run.
    """
    from ..compression.policy_table import paper_policy_table

    paper = paper_policy_table()
    entries, k90s, strengths, plans = {}, {}, {}, {}
    tasks_meas: dict = {}
    base_filled: dict = {}
    if base is not None:
        tasks_meas.update((base.measurements or {}).get("tasks", {}) or {})
        base_filled = dict((base.measurements or {}).get("filled", {}) or {})
    filled: dict[str, str] = {}
    for key in sorted(set(paper.entries) | set(base.entries if base else {}) | set(table.entries),
                      key=lambda k: (k[0], int(k[1]))):
        label = f"{key[0]}/{TokenType(key[1]).name.lower()}"
        if key in table.entries:  # measured now
            entries[key] = table.entries[key]
            k90s[key] = table.k90[key]
            if key in table.plans:
                plans[key] = table.plans[key]
        elif base is not None and key in base.entries:  # kept from the --merge table
            entries[key] = base.entries[key]
            if key in base.k90:
                k90s[key] = base.k90[key]
            if key in base.strengths:
                strengths[key] = base.strengths[key]
            if key in base.plans:
                plans[key] = base.plans[key]
            if label in base_filled:
                filled[label] = base_filled[label]
            elif key not in base.k90:
                filled[label] = "merged"  # an entry of the --merge table that no calibration measured
        else:
            entries[key] = paper.entries[key]
            filled[label] = "paper"
    tasks_meas.update(table.measurements.get("tasks", {}))
    measurements = {"tool": "python -m unicache_core.bagel.calibrate", "tasks": tasks_meas,
                    "filled": dict(sorted(filled.items())),
                    "filled_note": "pairs not measured by a calibration run: 'paper' = the paper's assignment "
                                   "(unicache_core/compression/tables/bagel-7b-mot.json), 'merged' = kept from the --merge table"}
    return PolicyTable(entries=entries, threshold=table.threshold, k90=k90s, model_id=table.model_id,
                       source="calibrated", strengths=strengths, plans=plans, geometry=table.geometry,
                       measurements=measurements)


# ------------------------------------------------------------------------------------------- CLI




def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m unicache_core.bagel.calibrate",
                description="Calibrate a UniCache policy table (K90 routing, docs/compression.md §8.4) "
                            "on a checkpoint")
    p.add_argument("--checkpoint", required=True, type=_path, help="BAGEL checkpoint folder")
    p.add_argument("--task", required=True, choices=sorted(TASK_NAMES), help="und (understanding) | t2i | edit")
    p.add_argument("--prompts", required=True, type=_path, help="UTF-8 text file, one prompt per line")
    p.add_argument("--images", type=_path, default=None,
                   help="folder of input images for edit / und (sorted, paired with the prompts round-robin); "
                        "default: deterministic synthetic images")
    p.add_argument("--out", required=True, type=_path, help="policy-table JSON to write")
    p.add_argument("--merge", action="store_true",
                   help="keep the other tasks' entries of an existing --out table (same model)")
    p.add_argument("--sensitivity", action="store_true",
                   help="also run each type evicted vs quantized alone and compare with the K90 choice")
    p.add_argument("--grid", action="store_true",
                   help="also measure each type's (rows kept, bits) grid at matched bytes and make it a joint entry "
                        "with the calibrated bits per budget level (docs/compression.md §11.4)")
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"],
                   help="num_timesteps of t2i / edit (steps-1 denoising steps), as in python -m unicache_core.bagel")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULTS["max_new_tokens"],
                   help="most decoded tokens per understanding prompt")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=DEFAULTS["dtype"], help="LLM/ViT dtype (VAE is fp32)")
    p.add_argument("--size", type=int, default=DEFAULTS["size"],
                   help="t2i output side and synthetic image width in px (multiple of 16)")
    p.add_argument("--device", default="auto", help="torch device, or 'auto' (cuda when available)")
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"], help="noise seed of every run")
    p.add_argument("-v", "--verbose", action="store_true", help="progress and library logs on stderr")
    return p


def _check_out(out: Path, merge: bool, model_id: str) -> PolicyTable | None:
    if out.is_dir():
        raise ValueError(f"--out: {out} is a directory; give the path of the JSON file to write, e.g. "
                         f"{out / 'unicache_policy.json'}")
    if out.exists() and not out.is_file():
        raise ValueError(f"--out: {out} exists and is not a regular file")
    probe = out.parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"--out: {probe} is not a directory, so {out} cannot be created")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise OSError(f"--out: cannot write into {probe}")
    if merge and out.is_file():
        try:
            return PolicyTable.load(out, model_id=model_id)
        except PolicyTableError as exc:
            raise ValueError(f"--merge: {exc}") from None
    return None


def _check_args(args: argparse.Namespace) -> dict:
    """Every argument, before any weights load; returns what the run needs."""
    from .accounting import check_positions, generation_positions, understanding_positions
    from .cli_checks import check_checkpoint_dir, resolve_device, with_flag
    from .config import load_bagel_config
    from .seeding import check_seed
    from .settings import check_int, check_output_size
    from .tokenizer import BagelTokenizer
    from .checkpoint.model_id import model_id_of

    task = TASK_NAMES[args.task]
    root = check_checkpoint_dir(args.checkpoint)
    try:
        model_id = model_id_of(root)
    except ValueError as exc:
        raise ValueError(f"--checkpoint: {exc}") from None
    prompts = read_prompts(args.prompts)
    if args.images is not None and task == "t2i":
        raise ValueError("--images: t2i takes no input images; drop --images (or use --task edit / und)")
    base = _check_out(args.out, args.merge, model_id)
    try:
        if task != "understanding":
            preset(task, num_timesteps=args.steps)
        check_int("max_new_tokens", args.max_new_tokens, 1)
        check_seed(args.seed)
    except ValueError as exc:
        raise with_flag(exc) from None
    device = resolve_device(args.device)
    config = load_bagel_config(root)
    if task == "t2i" or args.images is None:
        try:
            check_output_size(config, args.size, args.size)
        except ValueError as exc:
            raise ValueError(f"--size: {exc}".replace("`width`", "the size")) from None
    images = read_images(args.images) if args.images is not None else None
    tokenizer = BagelTokenizer.from_dir(root)
    for lineno, prompt in zip(prompt_line_numbers(args.prompts), prompts):
        if task == "understanding":
            used = understanding_positions(tokenizer, prompt, has_image=True, think=False)
        else:
            used = generation_positions(tokenizer, prompt, has_image=task == "edit", think=False)
        try:
            check_positions(config, used, 0, "prompt")
        except ValueError as exc:
            raise ValueError(f"--prompts: line {lineno} of {args.prompts}: {exc}") from None
        if task == "understanding":
            try:
                check_positions(config, used, args.max_new_tokens, "max_new_tokens")
            except ValueError as exc:
                raise ValueError(f"--max-new-tokens: with the prompt of line {lineno} of {args.prompts}: {exc}") \
                    from None
    return {"task": task, "prompts": prompts, "images": images, "device": device, "model_id": model_id, "base": base}


def _write(table: PolicyTable, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(table.to_dict(), indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()


def _fail(message: str) -> None:
    sys.stderr.write(f"error: {' '.join(message.split())}\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 ok, 2 expected failure, 130 interrupted)."""
    try:
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                            format="%(levelname)s %(name)s: %(message)s")
        checked = _check_args(args)
        from .checkpoint.loader import load_bagel

        loaded = load_bagel(args.checkpoint, dtype=_DTYPES[args.dtype], device=checked["device"])
        task = checked["task"]
        arguments = {"checkpoint": str(args.checkpoint), "task": args.task, "prompts": str(args.prompts),
                     "images": None if args.images is None else str(args.images), "out": str(args.out),
                     "merge": args.merge, "sensitivity": args.sensitivity, "grid": args.grid, "steps": args.steps,
                     "max_new_tokens": args.max_new_tokens, "dtype": args.dtype, "size": args.size,
                     "device": checked["device"], "seed": args.seed}
        table = calibrate(loaded, task, checked["prompts"], checked["images"], num_timesteps=args.steps,
                          max_new_tokens=args.max_new_tokens, size=args.size, seed=args.seed,
                          run_sensitivity=args.sensitivity, run_grid=args.grid, arguments=arguments,
                          progress=(lambda msg: logger.info("%s", msg)) if args.verbose else None)
        final = finish_table(table, task, checked["base"])
        _write(final, args.out)
        meas = table.measurements["tasks"][task]
        parts = [f"{t} K90 {v:.3f} -> {meas['choice'][t]}" for t, v in meas["k90"].items()]
        for t, plan in table.plans.items():
            parts.append(f"{TokenType(t[1]).name.lower()} plan " + ", ".join(
                f"{level:g}: {'full' if bits == 16 else f'{bits}-bit'}" for level, bits in plan.levels))
        agree = meas.get("sensitivity_agrees")
        if agree is not None:
            parts.append("sensitivity agrees: " + ", ".join(f"{t}={v}" for t, v in agree.items()))
        sys.stderr.write(f"calibrated {args.task} on {len(checked['prompts'])} prompt(s) ({checked['model_id']}): "
                         f"{'; '.join(parts)}; wrote {args.out}\n")
        sys.stderr.flush()
        return 0
    except KeyboardInterrupt:
        _fail("interrupted (Ctrl-C)")
        return 130
    except (MemoryError, torch.OutOfMemoryError) as exc:
        _fail(f"out of memory ({type(exc).__name__}); use fewer --steps, a smaller --size, --dtype bf16 or another "
              "--device")
        return 2
    except (UniCacheError, ValueError, OSError) as exc:
        _fail(str(exc) or type(exc).__name__)
        return 2


if __name__ == "__main__":
    sys.exit(main())
