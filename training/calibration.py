"""Calibrate UniCache's policy table on the shapes model, with world samples from the training seeds.

``python -m training.calibration CHECKPOINT [--prompts N] [--sensitivity] [--grid]`` writes
prompt files and images for the three tasks (captions; edit instructions with their source images;
questions with their scenes) and calibrates each task (:func:`unicache_core.bagel.calibration.cli.run_job`, what
``python -m unicache_core.bagel.calibrate`` runs), merging into ``CHECKPOINT/unicache_policy.json``, the table
``unicache`` uses by default for that checkpoint.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from unicache_core.bagel.calibration import CalibrationJob, CalibrationOptions
from unicache_core.bagel.calibration.cli import configure_logging, run_job
from unicache_core.cli import OneLineParser, path_arg
from unicache_core.compression.policy_table import CHECKPOINT_POLICY_FILE
from unicache_core.shapes import edit_sample, t2i_sample, understanding_sample

#: Calibration seeds: training seeds far from those the trainer's pool uses (0 .. pool size).
CALIBRATION_SEED0 = 10_000_000


def write_inputs(folder: Path, task: str, count: int) -> tuple[Path, Path | None]:
    """``prompts.txt`` (+ ``images/``) of ``count`` world samples for ``task``."""
    folder.mkdir(parents=True, exist_ok=True)
    prompts, images = [], folder / "images"
    if task != "t2i":
        images.mkdir(exist_ok=True)
    for i in range(count):
        seed = CALIBRATION_SEED0 + i
        if task == "t2i":
            prompts.append(t2i_sample(seed).caption())
            continue
        if task == "edit":
            e = edit_sample(seed)
            prompts.append(e.instruction)
            e.source.render().save(images / f"{i:04d}.png")
        else:
            scene, q = understanding_sample(seed)
            prompts.append(q.question)
            scene.render().save(images / f"{i:04d}.png")
    path = folder / "prompts.txt"
    path.write_text("\n".join(prompts) + "\n", encoding="utf-8")
    return path, images if task != "t2i" else None


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(
        prog="python -m training.calibration",
        description="Calibrate the shapes model's UniCache policy table (all three tasks).",
    )
    parser.add_argument("checkpoint", type=path_arg, help="checkpoint folder (the table is written into it)")
    parser.add_argument("--prompts", type=int, default=12, help="samples per task (default 12)")
    parser.add_argument("--steps", type=int, default=13, help="num_timesteps of t2i and edit (default 13)")
    parser.add_argument("--sensitivity", action="store_true", help="also compare evict vs quantize per type")
    parser.add_argument(
        "--grid",
        action="store_true",
        help="also measure each type's (rows kept, bits) grid and write joint entries with their plans",
    )
    args = parser.parse_args(argv)
    if args.prompts < 1:
        parser.error(f"--prompts must be >= 1, got {args.prompts}")
    out = Path(args.checkpoint) / CHECKPOINT_POLICY_FILE
    options = CalibrationOptions(
        num_timesteps=args.steps, max_new_tokens=4, size=128, sensitivity=args.sensitivity, grid=args.grid
    )
    configure_logging(verbose=False)
    with tempfile.TemporaryDirectory() as tmp:
        for i, task in enumerate(("und", "t2i", "edit")):
            prompts, images = write_inputs(Path(tmp) / task, task, args.prompts)
            job = CalibrationJob(
                checkpoint=Path(args.checkpoint),
                task=task,
                prompts=prompts,
                out=out,
                images=images,
                merge=i > 0,
                options=options,
                dtype="fp32",
            )
            code = run_job(job)
            if code:
                return code
    sys.stdout.write(f"wrote {out}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
