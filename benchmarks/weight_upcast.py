"""CPU cost of each weight dtype on one real-size BAGEL MLP matrix (18944 x 3584, 68M weights).

For each dtype of :data:`unicache_core.bagel.weights.WEIGHT_DTYPES`: the upcast alone and a whole layer call
(upcast + matmul + scale) of a ``[tokens, 3584]`` bf16 input, against the bf16 weight kept resident; for
int8 also torch's int8 weight-only kernel (``torch._weight_int8pack_mm``, the one torchao's CPU path would
reach for), which reads the int8 weight directly. Variants run interleaved and the best of ``--rounds`` is
kept, so a machine shared with other work still gives usable ratios.

    python -m benchmarks.weight_upcast [--tokens 256] [--rounds 5] [--threads 2] [--json PATH]
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch.nn import functional as F

from benchmarks.report_file import check_report_paths, write_json_report
from unicache_commands.flags import OneLineParser, path_arg
from unicache_core.bagel.modeling.operations import low_precision_operations, upcast_weight
from unicache_core.bagel.weights import WEIGHT_DTYPES

OUT_FEATURES, IN_FEATURES = 18944, 3584


def measure(tokens: int, rounds: int) -> dict[str, dict[str, float]]:
    """``{variant: {"seconds": best time, "ratio": / bf16 resident matmul}}``."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(OUT_FEATURES, IN_FEATURES, generator=gen) * 0.02
    x = torch.randn(tokens, IN_FEATURES, generator=gen).to(torch.bfloat16)
    resident = weight.to(torch.bfloat16)
    cpu = torch.device("cpu")
    variants: dict[str, Callable[[], object]] = {"bf16 resident: matmul": lambda: F.linear(x, resident)}
    for name, storage in WEIGHT_DTYPES.items():
        if storage is None or storage == torch.bfloat16:
            continue
        layer = low_precision_operations(storage).Linear(IN_FEATURES, OUT_FEATURES, bias=False, dtype=torch.bfloat16)
        layer.load_weight(weight)
        variants[f"{name}: upcast"] = lambda layer=layer: upcast_weight(
            layer.weight, layer.weight_scale, torch.bfloat16, cpu, scale_output=True
        )
        variants[f"{name}: layer call"] = lambda layer=layer: layer(x)
        if storage == torch.int8:
            scales = layer.weight_scale.to(torch.bfloat16)
            variants["int8: torch._weight_int8pack_mm"] = lambda layer=layer, scales=scales: torch._weight_int8pack_mm(
                x, layer.weight, scales
            )
    best = {name: float("inf") for name in variants}
    with torch.inference_mode():
        for fn in variants.values():  # warm-up
            fn()
        for _ in range(rounds):
            for name, fn in variants.items():
                start = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - start)
    base = best["bf16 resident: matmul"]
    return {name: {"seconds": s, "ratio": s / base} for name, s in best.items()}


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="rows of the input (default 256)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the best is kept (default 5)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", type=path_arg, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    check_report_paths(parser, [("--json", args.json, "JSON report")])
    if args.tokens < 1 or args.rounds < 1:
        parser.error(f"--tokens and --rounds must be >= 1, got {args.tokens} and {args.rounds}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    results = measure(args.tokens, args.rounds)
    for name, row in results.items():
        print(f"{name:36s} {row['seconds'] * 1000:9.1f} ms  {row['ratio']:6.2f}x")
    if args.json is not None:
        write_json_report(
            args.json,
            {
                "tokens": args.tokens,
                "threads": torch.get_num_threads(),
                "shape": [OUT_FEATURES, IN_FEATURES],
                "results": results,
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
