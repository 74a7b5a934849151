"""The files one ``understand`` / ``t2i`` / ``edit`` command line reads and writes, declared once and checked by the
one output guard (:func:`unicache_commands.output_files.check_outputs`) before the weights load.

The inputs are every ``--image``, ``--items`` and each image it names, ``--prompt-file`` and ``--policy`` (and the
checkpoint's files, by the guard's own rule); the outputs are ``--out``, the earlier rounds' images of an iterative
request (``<out stem>-1.png``, ...) and ``--report``. No output may be an input, a file of a checkpoint, a device or
FIFO, or another output: ``edit --image c.png --out c.png`` is refused (the source would be replaced), as is a
``--report`` onto an image the items file names.
"""

from __future__ import annotations

from pathlib import Path

from unicache_commands.output_files import check_outputs

from ..items import GenerateItem
from .items_file import read_items_file


def command_inputs(args) -> list[tuple[str, Path | None]]:
    """``(flag, path)`` of every file the command line reads (an ``--items`` file is read here for its images'
    paths; a mistake in it is its own one-line error)."""
    images = getattr(args, "image", None)
    inputs: list[tuple[str, Path | None]] = [
        ("--image", image) for image in (images if isinstance(images, list) else [images])
    ]
    items = getattr(args, "items", None)
    if items is not None:
        inputs.append(("--items", items))
        if items.is_file():
            _, paths = read_items_file(items, generation=args.command != "understand")
            inputs += [(f"--items {items}: image", path) for path in paths]
    for flag, name in (("--prompt-file", "prompt_file"), ("--policy", "policy")):
        inputs.append((flag, getattr(args, name, None)))
    return inputs


def round_paths(out: Path, items) -> list[Path]:
    """Where an iterative request's earlier rounds are written: ``<out stem>-<round><suffix>`` beside ``--out``
    (round 1 first), one for each ``generate`` item."""
    count = 0 if items is None else sum(isinstance(item, GenerateItem) for item in items)
    return [out.with_name(f"{out.stem}-{number}{out.suffix}") for number in range(1, count + 1)]


def check_command_outputs(args) -> tuple[Path, ...]:
    """Refuse any output of the command line that the guard refuses (module docstring); returns the earlier rounds'
    image paths."""
    out, report = getattr(args, "out", None), getattr(args, "report", None)
    rounds: list[Path] = []
    items = getattr(args, "items", None)
    if out is not None and items is not None and items.is_file():
        raw, _ = read_items_file(items, generation=args.command != "understand")
        rounds = round_paths(out, raw)
    outputs = [("--out", out, "image file")]
    outputs += [("--out", path, f"image of round {number}") for number, path in enumerate(rounds, 1)]
    outputs.append(("--report", report, "JSON report"))
    check_outputs(outputs, inputs=command_inputs(args), checkpoints=[getattr(args, "checkpoint", None)])
    return tuple(rounds)


__all__ = ["check_command_outputs", "command_inputs", "round_paths"]
