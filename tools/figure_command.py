"""The command line the README's figures share (``python -m tools.kv_plot``, ``python -m tools.pareto``): ``--results``
(the benchmarks' JSON folder) and ``--out`` (the PNG), the one output guard, and one line for results that cannot be
read or a missing matplotlib."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from unicache_commands.flags import OneLineParser, path_arg
from unicache_commands.output_files import check_outputs


def run_figure(
    parser: OneLineParser,
    argv: Sequence[str] | None,
    *,
    results: Path,
    out: Path,
    read: Callable[[Path], Any],
    render: Callable[[Any, Path], None],
) -> int:
    """Parse ``argv`` with ``parser`` (given ``--results`` and ``--out``, defaulting to ``results`` and ``out``), read
    the results with ``read(results_folder)``, draw them with ``render(read_value, out_png)``; 0, or 2 after one
    ``error:`` line."""
    parser.add_argument("--results", type=Path, default=results, help="the benchmarks' JSON folder")
    parser.add_argument("--out", type=path_arg, default=out, help="the PNG to write")
    args = parser.parse_args(argv)
    try:  # the one output guard: never an input, a device, a folder, a checkpoint's file
        check_outputs([("--out", args.out, "plot PNG")], input_folders=[("--results", args.results)])
    except (OSError, ValueError) as error:
        parser.error(str(error))
    try:
        drawn = read(args.results)
    except (OSError, KeyError, ValueError) as error:
        sys.stderr.write(f"error: {args.results}: cannot read the results the plot needs ({error!r})\n")
        return 2
    try:
        render(drawn, args.out)
    except ImportError:
        sys.stderr.write("error: the plot needs matplotlib: pip install -e '.[docs]'\n")
        return 2
    sys.stdout.write(f"{args.out}\n")
    return 0
