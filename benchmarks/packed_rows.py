"""Attention over N packed rows against attention over the same N rows at 16 bits (issue #65's row pair).

``python -m benchmarks.packed_rows [--quick] [--rows N] [--json PATH]``

One KV head group at BAGEL-7B's geometry (28 query heads, 4 KV heads, head dim 128): a :class:`FullStore` of ``N``
rows in the cache dtype and a :class:`QuantizedStore` of the same rows (2-bit keys per channel and values per token,
groups of 128, no residual rows), each attended through its own ``attend`` (the store's whole read: dequantizing
the packed rows in chunks, then the exact attention, merged by log-sum-exp). For fp32 and bf16 caches, and for a
256-query call (a denoising step's latent block) and a one-query call (a decoded token), the median time of each
store and their ratio. The rows packed cost what they cost to read and no more: their attention is the same
exact attention over the same number of rows, so the ratio is the price of the reading alone.

Run it on an idle machine (one thread by default: the ratio, not the absolute time, is what is compared).
"""

from __future__ import annotations

import logging
import statistics
import time

import torch

from benchmarks.report_file import check_report_paths, write_json_report
from unicache_commands.flags import OneLineParser, path_arg
from unicache_core.kv.quantized_store import QuantizedStore
from unicache_core.kv.stores import FullStore
from unicache_core.kv.token_types import TokenType

logger = logging.getLogger("benchmarks.packed_rows")
#: BAGEL-7B-MoT's attention geometry.
QUERY_HEADS, KV_HEADS, HEAD_DIM = 28, 4, 128
#: The rows of the pair: about one branch of a 2-image 1024² edit (kv_attention's context).
ROWS = 18_800
QUERY_COUNTS = (256, 1)
DTYPES = (torch.float32, torch.bfloat16)
BITS, GROUP = 2, 128


def _stores(rows: int, dtype: torch.dtype, seed: int) -> tuple[FullStore, QuantizedStore]:
    """``rows`` random rows held at full width and packed (the same keys and values)."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(rows, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
    values = torch.randn(rows, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
    index = torch.arange(rows, dtype=torch.int32)
    full = FullStore(keys, values, index, TokenType.SOURCE_VIT)
    packed = QuantizedStore.from_kv(keys, values, index, BITS, GROUP, residual=0, token_type=TokenType.SOURCE_VIT)
    return full, packed


def _interleaved_medians(store_a, store_b, queries: torch.Tensor, repeats: int) -> tuple[float, float]:
    """The median seconds of ``store.attend(queries)`` for both stores, timed in turn (a load change hits both)."""
    store_a.attend(queries), store_b.attend(queries)  # warm-up: the scratch buffers and each kernel's first call
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for store, spent in ((store_a, times[0]), (store_b, times[1])):
            start = time.perf_counter()
            store.attend(queries)
            spent.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def pair_rows(rows: int = ROWS, repeats: int = 9, threads: int = 1, seed: int = 0) -> list[dict]:
    """One row per (cache dtype, query count): both stores' median seconds, interleaved per repeat block."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = []
        for dtype in DTYPES:
            full, packed = _stores(rows, dtype, seed)
            for count in QUERY_COUNTS:
                queries = torch.randn(count, QUERY_HEADS, HEAD_DIM).to(dtype)
                t_full, t_packed = _interleaved_medians(full, packed, queries, repeats)
                logger.info("%s, %d queries: full %.5f s, packed %.5f s", dtype, count, t_full, t_packed)
                out.append(
                    {
                        "dtype": str(dtype).removeprefix("torch."),
                        "queries": count,
                        "rows": rows,
                        "full_seconds": t_full,
                        "packed_seconds": t_packed,
                        "packed_over_full": t_packed / t_full,
                        "full_bytes": full.nbytes(),
                        "packed_bytes": packed.nbytes(),
                    }
                )
        return out
    finally:
        torch.set_num_threads(saved)


def format_table(rows: list[dict]) -> str:
    lines = [f"{'dtype':<10}{'queries':>8}{'rows':>8}{'full ms':>10}{'packed ms':>11}{'packed/full':>13}{'bytes x':>9}"]
    for r in rows:
        lines.append(
            f"{r['dtype']:<10}{r['queries']:>8}{r['rows']:>8}{1e3 * r['full_seconds']:>10.3f}"
            f"{1e3 * r['packed_seconds']:>11.3f}{r['packed_over_full']:>13.2f}"
            f"{r['full_bytes'] / r['packed_bytes']:>9.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2,048 rows, 3 repeats (seconds)")
    parser.add_argument("--rows", type=int, default=None, help=f"rows of each store (default {ROWS})")
    parser.add_argument("--repeats", type=int, default=None, help="timing repeats (default 9, quick 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--json", type=path_arg, help="write the results JSON here")
    args = parser.parse_args(argv)
    check_report_paths(parser, [("--json", args.json, "JSON report")])
    if args.rows is not None and args.rows < 1:
        parser.error(f"--rows must be a positive row count, got {args.rows}")
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    rows = args.rows or (2048 if args.quick else ROWS)
    repeats = args.repeats or (3 if args.quick else 9)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    results = pair_rows(rows, repeats, args.threads)
    config = {"rows": rows, "repeats": repeats, "threads": args.threads, "bits": BITS, "group": GROUP}
    report = {"config": config, "results": results}
    logger.info("%s", format_table(results))
    if args.json:
        write_json_report(args.json, report)


if __name__ == "__main__":
    main()
