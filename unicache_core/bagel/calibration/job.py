"""One calibration job from files to a table file: check every input before any weights load, load the
checkpoint, calibrate the task, complete the table and write it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ...compression.policy_table import PolicyTable
from ..settings import preset
from .inputs import prompt_line_numbers, read_images, read_prompts
from .options import DTYPES, TASK_NAMES, CalibrationOptions
from .run import calibrate
from .tables import check_out, finish_table, write_table


@dataclass(frozen=True)
class CalibrationJob:
    """What ``python -m unicache_core.bagel.calibrate`` is asked to do, as one object.

    Attributes:
        checkpoint: BAGEL checkpoint folder.
        task: ``und``, ``t2i`` or ``edit`` (the command line's names, :data:`TASK_NAMES`).
        prompts: UTF-8 text file, one prompt per line.
        out: policy-table JSON to write.
        images: folder of input images for edit / understanding (``None`` = synthetic images).
        merge: keep the other tasks' entries of an existing ``out`` table (same model).
        options: how the requests run (steps, size, seed, sensitivity, grid, ...).
        dtype: ``bf16`` or ``fp32`` (LLM/ViT; the VAE is fp32).
        device: torch device, or ``auto`` (cuda when available).
    """

    checkpoint: Path
    task: str
    prompts: Path
    out: Path
    images: Path | None = None
    merge: bool = False
    options: CalibrationOptions = field(default_factory=CalibrationOptions)
    dtype: str = "bf16"
    device: str = "auto"

    def arguments(self, device: str) -> dict:
        """The job as the measurements record it (``device`` = the resolved device)."""
        o = self.options
        return {
            "checkpoint": str(self.checkpoint),
            "task": self.task,
            "prompts": str(self.prompts),
            "images": None if self.images is None else str(self.images),
            "out": str(self.out),
            "merge": self.merge,
            "sensitivity": o.sensitivity,
            "grid": o.grid,
            "steps": o.num_timesteps,
            "max_new_tokens": o.max_new_tokens,
            "dtype": self.dtype,
            "size": o.size,
            "device": device,
            "seed": o.seed,
        }


def _check_prompt_lengths(job: CalibrationJob, task: str, prompts: list[str], config, tokenizer) -> None:
    from ..memory.accounting import check_positions, generation_positions, understanding_positions

    for lineno, prompt in zip(prompt_line_numbers(job.prompts), prompts):
        if task == "understanding":
            used = understanding_positions(tokenizer, prompt, has_image=True, think=False)
        else:
            used = generation_positions(tokenizer, prompt, has_image=task == "edit", think=False)
        try:
            check_positions(config, used, 0, "prompt")
        except ValueError as exc:
            raise ValueError(f"--prompts: line {lineno} of {job.prompts}: {exc}") from None
        if task == "understanding":
            try:
                check_positions(config, used, job.options.max_new_tokens, "max_new_tokens")
            except ValueError as exc:
                raise ValueError(
                    f"--max-new-tokens: with the prompt of line {lineno} of {job.prompts}: {exc}"
                ) from None


def check_job(job: CalibrationJob) -> dict:
    """Every input of ``job``, before any weights load (one ``--flag:`` error per mistake).

    Returns ``{"task", "prompts", "images", "device", "model_id", "base"}``: the pipeline task name, the
    prompts, the ``[(name, image)]`` of ``job.images`` (or ``None``), the resolved device, the checkpoint's
    model id and the ``--merge`` table (or ``None``).
    """
    from ..checkpoint.model_id import model_id_of
    from ..cli.checks import check_checkpoint_dir, resolve_device, with_flag
    from ..config import load_bagel_config
    from ..seeding import check_seed
    from ..settings import check_int, check_output_size
    from ..tokenizer import BagelTokenizer

    if job.task not in TASK_NAMES:
        raise ValueError(f"--task: {job.task!r} is not a calibration task; use one of {sorted(TASK_NAMES)}")
    if job.dtype not in DTYPES:
        raise ValueError(f"--dtype: {job.dtype!r} is not a calibration dtype; use one of {sorted(DTYPES)}")
    options = job.options
    task = TASK_NAMES[job.task]
    root = check_checkpoint_dir(job.checkpoint)
    try:
        model_id = model_id_of(root)
    except ValueError as exc:
        raise ValueError(f"--checkpoint: {exc}") from None
    prompts = read_prompts(job.prompts)
    if job.images is not None and task == "t2i":
        raise ValueError("--images: t2i takes no input images; drop --images (or use --task edit / und)")
    base = check_out(job.out, job.merge, model_id, checkpoint=root, prompts=job.prompts, images=job.images)
    try:
        if task != "understanding":
            preset(task, num_timesteps=options.num_timesteps)
        check_int("max_new_tokens", options.max_new_tokens, 1)
        check_seed(options.seed)
    except ValueError as exc:
        raise with_flag(exc) from None
    device = resolve_device(job.device)
    config = load_bagel_config(root)
    if task == "t2i" or job.images is None:
        try:
            check_output_size(config, options.size, options.size)
        except ValueError as exc:
            raise ValueError(f"--size: {exc}".replace("`width`", "the size")) from None
    images = read_images(job.images) if job.images is not None else None
    _check_prompt_lengths(job, task, prompts, config, BagelTokenizer.from_dir(root))
    return {"task": task, "prompts": prompts, "images": images, "device": device, "model_id": model_id, "base": base}


def calibrate_job(job: CalibrationJob, progress: Callable[[str], None] | None = None) -> PolicyTable:
    """Check ``job``, load its checkpoint, calibrate its task and write the completed table to ``job.out``.

    Returns the written table; its ``measurements["tasks"][task]`` holds this run's measurements.
    Raises ``ValueError`` / ``OSError`` / :class:`~unicache_core.errors.UniCacheError` with one-line messages
    naming the flag at fault.
    """
    from ..checkpoint.loader import load_bagel

    checked = check_job(job)
    loaded = load_bagel(job.checkpoint, dtype=DTYPES[job.dtype], device=checked["device"])
    task = checked["task"]
    table = calibrate(
        loaded,
        task,
        checked["prompts"],
        checked["images"],
        job.options,
        arguments=job.arguments(checked["device"]),
        progress=progress,
    )
    final = finish_table(table, task, checked["base"])
    write_table(final, job.out)
    return final


__all__ = ["CalibrationJob", "calibrate_job", "check_job"]
