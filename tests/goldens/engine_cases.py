"""Goldens of our own engine: every method on the shipped workflows' requests, on the bundled model.

Each case runs one request of the shipped workflows (``workflows/api``: the text-to-image prompt at 128 px, the
edit of ``unicache_example.png``, the understanding question about ``unicache_position.png``; 25 timesteps,
seed 42, fp32 on the CPU as the nodes run there) with one KV method at its default target or at 10%, and keeps
a fingerprint of what came out: the image's pixels and final latent (or the answer's text and token ids) and
the KV report (every step's bytes, rows, bits, budgets, rho and masses per branch and type, hashed; the
summary kept readable). ``tests/test_goldens.py`` compares a fresh run with ``engine_outputs.json``.

Refresh after a change that is meant to move outputs (say which and why in the commit)::

    PYTHONPATH=tests .venv/bin/python -m goldens.engine_cases --write
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

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
#: Report fields that are clocks (never part of a fingerprint).
_TIMERS = ("attention_s", "stats_s", "alloc_s", "step_s", "stats_seconds", "alloc_seconds", "attention_seconds")


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


def report_fingerprint(report: dict) -> dict:
    """The KV report without its clocks: the summary (readable) and a hash of every step's record."""
    clean = _strip_timers(report)
    steps = json.dumps(clean.get("steps", []), sort_keys=True).encode()
    summary = clean.get("summary") or {}
    return {"summary": summary, "steps_sha256": _sha(steps), "steps": len(clean.get("steps", []))}


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
    return {
        "size": list(image.size),
        "pixels_sha256": _sha(image.tobytes()),
        "latent_sha256": _sha(result.latents.detach().float().contiguous().numpy().tobytes()),
    }


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
    text = json.dumps({"cases": outputs}, indent=1, sort_keys=True) + "\n"
    if args.write:
        GOLDENS.write_text(text)
        logging.getLogger(__name__).warning("wrote %d cases to %s", len(outputs), GOLDENS)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
