"""Goldens of our own engine: every method on the shipped workflows' requests, on the bundled model.

Each case runs one request of the shipped workflows (``workflows/api``: the text-to-image prompt at 128 px, the
edit of ``unicache_example.png``, the understanding question about ``unicache_position.png``; 25 timesteps,
seed 42, fp32 on the CPU as the nodes run there) with one KV method at its default target or at 10%, and keeps
a fingerprint of what came out, and ``tests/test_goldens.py`` compares a fresh run with ``engine_outputs.json``:

- what is discrete is kept exactly: the answer's text and token ids, the image size, and the KV report's
  structure (every step's fields, branches, token types and flags: the report with its numbers taken out, hashed);
- what is continuous is kept as numbers and compared within a tolerance: a sample of the final latent (every
  :data:`LATENT_STRIDE`-th value), the image as the means of its 8 x 8 pixel blocks, the report's numbers (the
  summary's one by one; the steps' bytes, rows, bits and budgets summed, and their rho, masses and ratios summed).

Why tolerances: the CPU kernels torch picks differ between machines (AVX2, AVX-512, another vendor's), and each
rounds a few last bits differently. Measured on one machine with ``ATEN_CPU_CAPABILITY=avx2`` against its AVX-512
default, every case here: latents moved by at most 1.6e-3 (UniCache's rho crossing a threshold a hair later),
pixels by at most 1 level, the report's structure not at all and its numbers by at most 2e-6 relative. A change
of behaviour moves them by far more (another method's latents differ from full KV's by 0.1 and more). The
tolerances are :data:`LATENT_ATOL`, :data:`PIXEL_ATOL` and :data:`NUMBER_RTOL`.

Refresh after a change that is meant to move outputs (say which and why in the commit)::

    PYTHONPATH=tests .venv/bin/python -m goldens.engine_cases --write
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
GOLDENS = Path(__file__).resolve().parent / "engine_outputs.json"
BUNDLED = ROOT / "models" / "bagel" / "unicache-shapes"
ASSETS = ROOT / "workflows" / "assets"
#: Every method of the pack, in the order the goldens list them.
METHODS = ("full", "unicache", "h2o", "snapkv", "pyramidkv", "streamingllm", "kivi", "vlcache")
T2I_PROMPT = "a large red circle at the top left and a small blue square at the center on a white background"
EDIT_PROMPT = "change the background to black"
UND_PROMPT = "where is the red circle?"
#: Every how many latent values one is kept in the fingerprint (a 128 px image's latent has 4,096).
LATENT_STRIDE = 8
#: Most a latent value may move between machines (module docstring: 1.6e-3 measured).
LATENT_ATOL = 5e-3
#: Most an 8 x 8 block's mean pixel value (0-255) may move between machines (1 level measured, on a few pixels).
PIXEL_ATOL = 1.0
#: Most the report's numbers may move between machines, relative (2e-6 measured: a rho a hair lower gives a budget a
#: few bytes smaller).
NUMBER_RTOL = 1e-4
#: Report fields that are clocks (never part of a fingerprint).
_TIMERS = (
    "attention_s",
    "stats_s",
    "alloc_s",
    "pack_s",
    "step_s",
    "stats_seconds",
    "alloc_seconds",
    "attention_seconds",
    "prefill_seconds",
)


@dataclass(frozen=True)
class Case:
    """One golden request: ``task`` with ``method`` at ``target`` (``None``: the method's default)."""

    task: str
    method: str
    target: float | None

    @property
    def name(self) -> str:
        return f"{self.task}/{self.method}/{'default' if self.target is None else self.target}"


CASES = tuple(
    Case(task, method, target)
    for task in ("t2i", "edit", "understanding")
    for method in METHODS
    for target in (None, 0.1)
    if not (method == "full" and target is not None)
)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _strip_timers(value):
    if isinstance(value, dict):
        return {k: _strip_timers(v) for k, v in value.items() if k not in _TIMERS}
    if isinstance(value, list):
        return [_strip_timers(v) for v in value]
    if isinstance(value, float):
        return round(value, 9)
    return value


def _structure(value):
    """``value`` with every number replaced by ``"n"`` (what is left: the report's fields, branches, types, flags)."""
    if isinstance(value, dict):
        return {k: _structure(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_structure(v) for v in value]
    return "n" if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def _total(value, kind: type) -> float:
    """The sum of the magnitudes of every number of type ``kind`` (``int`` or ``float``) in ``value``."""
    if isinstance(value, dict):
        return sum(_total(v, kind) for v in value.values())
    if isinstance(value, list):
        return sum(_total(v, kind) for v in value)
    return abs(value) if type(value) is kind else 0


def report_fingerprint(report: dict) -> dict:
    """The KV report without its clocks: the summary (readable), a hash of the steps' structure (fields, branches,
    types, flags) and the sums of their whole numbers (bytes, rows, bits, budgets) and real numbers (rho, masses)."""
    clean = _strip_timers(report)
    steps = clean.get("steps", [])
    return {
        "summary": clean.get("summary") or {},
        "structure_sha256": _sha(json.dumps(_structure(steps), sort_keys=True).encode()),
        "whole_total": _total(steps, int),
        "reals_total": round(_total(steps, float), 6),
        "steps": len(steps),
    }


def load_bundled():
    """The bundled model in fp32 on the CPU, as the workflows' loader (dtype ``auto``) gives it there."""
    from unicache_core.bagel.checkpoint.loader import load_bagel

    return load_bagel(BUNDLED, dtype=torch.float32, device="cpu")


def run_case(loaded, case: Case) -> dict:
    """The fingerprint of ``case`` on ``loaded``."""
    from unicache_core.bagel.pipeline import BagelPipeline
    from unicache_core.bagel.settings import preset
    from unicache_core.compression import make_cache_factory

    settings = {} if case.target is None else {"kv_target": case.target}
    factory = make_cache_factory(case.method, checkpoint_dir=str(BUNDLED), **settings)
    pipe = BagelPipeline(loaded, factory)
    if case.task == "understanding":
        image = Image.open(ASSETS / "unicache_position.png")
        result = pipe.understand(UND_PROMPT, image, preset("understanding", max_new_tokens=8), seed=0)
        out = {"text": result.text, "token_ids": list(result.token_ids)}
    elif case.task == "t2i":
        result = pipe.text_to_image(T2I_PROMPT, preset("t2i", width=128, height=128, num_timesteps=25), seed=42)
        out = _image_fingerprint(result)
    else:
        image = Image.open(ASSETS / "unicache_example.png")
        result = pipe.edit(EDIT_PROMPT, image, preset("edit", num_timesteps=25), seed=42)
        out = _image_fingerprint(result)
    out["kv"] = report_fingerprint(result.kv_report)
    return out


def _image_fingerprint(result) -> dict:
    image = result.image.convert("RGB")
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32)).permute(2, 0, 1)  # [3, H, W]
    blocks = torch.nn.functional.avg_pool2d(pixels.unsqueeze(0), 8, ceil_mode=True)[0]  # [3, H/8, W/8]
    latent = result.latents.detach().float().flatten()
    return {
        "size": list(image.size),
        "pixel_blocks": [round(v, 3) for v in blocks.flatten().tolist()],
        "latent_sample": [round(v, 6) for v in latent[::LATENT_STRIDE].tolist()],
    }


def differences(want, got, path: str = "") -> list[str]:
    """Every leaf where ``got`` differs from ``want`` beyond the module's tolerances, as ``path: want -> got``."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = []
        for key in sorted(set(want) | set(got)):
            out += differences(want.get(key), got.get(key), f"{path}/{key}")
        return out
    leaf = path.rsplit("/", 1)[-1]
    if leaf in ("latent_sample", "pixel_blocks") and isinstance(want, list) and isinstance(got, list):
        tolerance = LATENT_ATOL if leaf == "latent_sample" else PIXEL_ATOL
        worst = max((abs(a - b) for a, b in zip(want, got)), default=0.0)
        if len(want) == len(got) and worst <= tolerance:
            return []
        return [f"{path}: moved by {worst:.3g} (at most {tolerance}), lengths {len(want)} -> {len(got)}"]
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (want, got))
    if numbers and math.isclose(want, got, rel_tol=NUMBER_RTOL, abs_tol=1e-9):
        return []
    return [] if want == got else [f"{path}: {want!r} -> {got!r}"]


def _numbers_on_one_line(text: str) -> str:
    """``text`` (indented JSON) with each list of plain numbers written on one line (the samples stay readable)."""
    return re.sub(
        r"\[\s*(-?[0-9][-0-9.e+]*(?:,\s*-?[0-9][-0-9.e+]*)*)\s*\]",
        lambda m: "[" + re.sub(r"\s+", " ", m.group(1)) + "]",
        text,
    )


def run_all(cases=CASES) -> dict[str, dict]:
    """Every case's fingerprint, by case name (one thread, as the unit tests run torch)."""
    loaded = load_bundled()
    return {case.name: run_case(loaded, case) for case in cases}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write {GOLDENS.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    outputs = run_all()
    text = _numbers_on_one_line(json.dumps({"cases": outputs}, indent=1, sort_keys=True)) + "\n"
    if args.write:
        GOLDENS.write_text(text)
        logging.getLogger(__name__).warning("wrote %d cases to %s", len(outputs), GOLDENS)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
