"""The packed-KV attention kernel against dequantize-then-attend and full-width rows, at BAGEL-7B's heads on a GPU.

``python -m benchmarks.gpu_kernels [--rows 5120,10240,20480,40960] [--queries 1,4096] [--bits 2,4] [--group 32]
[--residual 128] [--heads 28,4] [--head-dim 128] [--repeats 20] [--json PATH] [--device cuda]``

For every (rows, bits, queries): one KV head group of BAGEL-7B-MoT's attention (28 query heads over 4 KV heads of 128
channels, bf16) over a :class:`~unicache_core.kv.quantized_store.QuantizedStore` of ``rows`` rows per KV head (KIVI's
layout: keys per channel, values per token, in groups of ``--group``; the last ``--residual`` rows at full width).
One query is a decoded answer token, 4096 a denoising step's 1024² latent block (non-causal). Three ways, each timed
as the median of ``--repeats`` calls after warm-up (CUDA events):

- ``kernel_ms``: :func:`~unicache_core.kv.packed_attention_triton.packed_attention` (the Triton kernel, what
  ``QuantizedStore.attend`` selects on CUDA; ``selected`` says whether it did);
- ``dequant_ms``: ``QuantizedStore.attend`` with the kernel off (today's path: dequantize chunks to bf16, then the
  fused attention), ``full_ms``: the fused attention over the same rows at full width (full KV's cost);
- ``store_bytes`` / ``full_bytes`` (what the rows hold), ``kernel_gbps`` (the store's bytes over the kernel's time),
  ``out_error`` / ``lse_error`` (the kernel against today's path, max relative), the row split used.

The report names the device (``config.gpu``). ``--device cpu`` (Triton's interpreter, set before Triton is imported;
small shapes only) is the dry run of the script itself.
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.report_file import check_report_paths, write_json_report
from unicache_commands.flags import OneLineParser, path_arg

logger = logging.getLogger("benchmarks.gpu_kernels")


def _ints(text: str) -> tuple[int, ...]:
    values = tuple(int(part) for part in text.split(","))
    if not values or min(values) < 1:
        raise ValueError(f"expected positive integers, got {text!r}")
    return values


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` calls, after two untimed ones (compilation, allocator)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            began = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - began))
    return statistics.median(times)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


def measure(rows: int, bits: int, tq: int, settings: dict, device: torch.device) -> dict:
    """One row of the report (module docstring)."""
    from unicache_core.kv import packed_attention_triton as pat
    from unicache_core.kv.attention import attention_with_lse
    from unicache_core.kv.quantized_store import QuantizedStore

    hq, hkv, d = settings["heads"][0], settings["heads"][1], settings["head_dim"]
    gen = torch.Generator(device=device).manual_seed(rows + bits)
    k = torch.randn(rows, hkv, d, generator=gen, device=device)
    k[:, :, :4] *= 8  # outlier channels, as keys have
    k, v = k.to(torch.bfloat16), torch.randn(rows, hkv, d, generator=gen, device=device).to(torch.bfloat16)
    q = torch.randn(tq, hq, d, generator=gen, device=device).to(torch.bfloat16)
    index = torch.arange(rows, dtype=torch.int32, device=device)
    store = QuantizedStore.from_kv(k, v, index, bits, settings["group"], settings["residual"])
    kernel_out, kernel_lse = pat.packed_attention(store, q)
    with pat.kernel_disabled():
        torch_out, torch_lse = store.attend(q)
    repeats = settings["repeats"]
    row = {
        "rows": rows, "bits": bits, "queries": tq, "group": settings["group"], "residual": settings["residual"],
        "query_heads": hq, "kv_heads": hkv, "head_dim": d,
        "selected": pat.packed_attention_kernel(store, q) is not None,
        "splits": pat.launch_grid(store, q).splits,
        "kernel_ms": _timed(lambda: pat.packed_attention(store, q), device, repeats),
    }  # fmt: skip
    with pat.kernel_disabled():
        row["dequant_ms"] = _timed(lambda: store.attend(q), device, repeats)
    row["full_ms"] = _timed(lambda: attention_with_lse(q, k, v), device, repeats)
    row["store_bytes"] = sum(t.nbytes for t in store.tensors())
    row["full_bytes"] = k.nbytes + v.nbytes
    row["kernel_gbps"] = row["store_bytes"] / (row["kernel_ms"] * 1e6)
    row["speedup_vs_dequant"] = row["dequant_ms"] / row["kernel_ms"]
    row["speedup_vs_full"] = row["full_ms"] / row["kernel_ms"]
    row["out_error"] = _relative(kernel_out, torch_out)
    row["lse_error"] = _relative(kernel_lse, torch_lse)
    return row


def run(settings: dict, device: str) -> dict:
    """Every (rows, bits, queries) row of ``settings`` on ``device``; the report with its ``config``."""
    dev = torch.device(device)
    start = time.perf_counter()
    results = []
    for tq in settings["queries"]:
        for bits in settings["bits"]:
            for rows in settings["rows"]:
                results.append(measure(rows, bits, tq, settings, dev))
                logger.info("%s", format_table(results[-1:]).splitlines()[-1])
    config = {
        **{key: list(value) if isinstance(value, tuple) else value for key, value in settings.items()},
        "device": device,
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "seconds": round(time.perf_counter() - start, 1),
    }
    return {"config": config, "results": results}


def format_table(rows: list[dict]) -> str:
    lines = [
        f"{'rows':>6s} {'bits':>4s} {'q':>5s} {'split':>5s} {'kernel ms':>9s} {'dequant ms':>10s} {'full ms':>8s} "
        f"{'x deq':>6s} {'x full':>6s} {'GB/s':>7s} {'store MB':>8s} {'full MB':>8s} {'out err':>8s}"
    ]
    for r in rows:
        lines.append(
            f"{r['rows']:6d} {r['bits']:4d} {r['queries']:5d} {r['splits']:5d} {r['kernel_ms']:9.3f} "
            f"{r['dequant_ms']:10.3f} {r['full_ms']:8.3f} {r['speedup_vs_dequant']:6.2f} {r['speedup_vs_full']:6.2f} "
            f"{r['kernel_gbps']:7.1f} {r['store_bytes'] / 1e6:8.2f} {r['full_bytes'] / 1e6:8.2f} {r['out_error']:8.1e}"
        )
    return "\n".join(lines)


def _parser() -> OneLineParser:
    parser = OneLineParser(prog="python -m benchmarks.gpu_kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=_ints, default=(5120, 10240, 20480, 40960), help="rows per KV head")
    parser.add_argument("--queries", type=_ints, default=(1, 4096), help="queries per call (1: decode)")
    parser.add_argument("--bits", type=_ints, default=(2, 4), help="bit widths of keys and values (2, 4, 8)")
    parser.add_argument("--group", type=int, default=32, help="quantization group size")
    parser.add_argument("--residual", type=int, default=128, help="full-width rows at the end of the store")
    parser.add_argument("--heads", type=_ints, default=(28, 4), help="query heads,KV heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per way (their median)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", type=path_arg, default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    check_report_paths(parser, [("--json", args.json, "JSON report")])
    if len(args.heads) != 2 or args.heads[0] % args.heads[1]:
        parser.error(f"--heads must be query heads,KV heads with the first a multiple of the second, got {args.heads}")
    if not set(args.bits) <= {1, 2, 4, 8} or min(args.group, args.repeats, args.head_dim) < 1 or args.residual < 0:
        parser.error("--bits must be among 1, 2, 4, 8; --group, --repeats and --head-dim positive; --residual >= 0")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.stderr.write("error: --device cuda but no CUDA device is visible; run it on the GPU machine\n")
        return 2
    if not args.device.startswith("cuda"):
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--device cpu runs Triton's interpreter: start a fresh process (Triton is already imported)")
        os.environ["TRITON_INTERPRET"] = "1"  # read when Triton is first imported
    names = ("rows", "queries", "bits", "group", "residual", "heads", "head_dim", "repeats")
    settings = {key: getattr(args, key) for key in names}
    report = run(settings, args.device)
    sys.stdout.write(format_table(report["results"]) + "\n")
    if args.json is not None:
        write_json_report(Path(args.json), report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
