"""The packed-KV attention kernel's cases, run by Triton's interpreter in a fresh process:
``TRITON_INTERPRET=1 python tests/packed_kernel_cases.py REPORT.json``.

Triton decorates its own standard library (``tl.zeros``, ``tl.max``, ...) when it is first imported, and only a
process that imports it with ``TRITON_INTERPRET=1`` interprets those; so the unit tests
(tests/test_packed_attention_triton.py) start this script once and assert on its report. Importing this module runs
nothing (the tests read :data:`LAYOUTS` from it); every number is measured against the torch path over the same
store: fp32 attention over its dequantized rows (:func:`reference`) and ``QuantizedStore.attend`` on the CPU.
"""

from __future__ import annotations

import json
import math
import sys
import time

import torch

#: (rows, bits, value bits, key per token, group, residual, layout, query heads, queries, magnitude, head dim);
#: 2 KV heads.
LAYOUTS = {
    "2bit-g16-decode": (77, 2, None, False, 16, 0, "shared", 2, 1, 1.0, 32),  # ragged last key group
    "4bit-g8-r5-gqa2-decode": (77, 4, None, False, 8, 5, "shared", 4, 1, 1.0, 32),
    "8bit-g32-r5-37q": (77, 8, None, False, 32, 5, "shared", 4, 37, 1.0, 32),  # many queries (a denoising block)
    "2bit-g128-gqa3": (70, 2, None, False, 128, 3, "shared", 6, 9, 1.0, 32),  # one short key group, a row's values one
    "4bit-all-residual": (64, 4, None, False, 16, 64, "shared", 2, 3, 1.0, 32),  # no quantized row
    "2bit-1bit-values": (61, 2, 1, False, 16, 4, "shared", 4, 5, 1.0, 32),  # fitted 1-bit values (§11.13)
    "2bit-keys-per-token": (45, 2, None, True, 8, 4, "shared", 4, 2, 1.0, 32),  # §11.13
    "4bit-keys-per-token-1bit-values": (45, 4, 1, True, 32, 0, "shared", 2, 1, 1.0, 32),
    "2bit-per-head-bitmap": (77, 2, None, False, 16, 6, "bitmap", 4, 3, 1.0, 32),  # RowIndex, bitmap encoding
    "8bit-per-head-list": (53, 8, None, False, 8, 2, "list", 4, 20, 1.0, 32),  # RowIndex, list encoding
    "8bit-fp32-scales": (60, 8, None, False, 16, 3, "shared", 4, 2, 1e5, 32),  # magnitudes past fp16's scales
    "4bit-g64-gqa7-decode": (77, 4, None, False, 64, 5, "shared", 14, 1, 1.0, 32),  # BAGEL-7B's 7 query heads a KV head
    "8bit-1bit-values-per-head-40q": (61, 8, 1, False, 32, 4, "bitmap", 4, 40, 1.0, 32),
    "4bit-d48": (50, 4, None, False, 16, 3, "shared", 4, 3, 1.0, 48),  # a head dim short of a power of two
    "2bit-d128-gqa7": (40, 2, None, False, 32, 2, "shared", 14, 2, 1.0, 128),  # BAGEL-7B's head dim
}


def make_store(
    rows,
    heads=2,
    d=32,
    *,
    bits=2,
    group=16,
    residual=0,
    value_bits=None,
    key_per_token=False,
    layout="shared",
    dtype=torch.float32,
    magnitude=1.0,
    seed=0,
):
    """A quantized store of ``rows`` rows per KV head; ``layout``: ``shared`` (a ``[T]`` index), ``bitmap`` or
    ``list`` (per-head rows, a RowIndex of that encoding)."""
    from unicache_core.kv.quantized_store import QuantizedStore
    from unicache_core.kv.token_types import TokenType

    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(heads, rows, d, generator=gen) * magnitude
    v = torch.randn(heads, rows, d, generator=gen) * magnitude
    k[:, :, 3] += 4.0 * magnitude  # an outlier channel, as keys have
    if layout == "shared":
        index = torch.arange(rows, dtype=torch.int32)
    else:  # each head its own rows out of rows + 3; in ascending order the bitmap names them, shuffled only a list
        picks = [torch.randperm(rows + 3, generator=gen)[:rows] for _ in range(heads)]
        index = torch.stack([p.sort().values if layout == "bitmap" else p for p in picks]).int()
    store = QuantizedStore.from_head_rows(
        k.to(dtype),
        v.to(dtype),
        index,
        bits,
        group,
        residual,
        TokenType.SOURCE_VAE,
        fit_values=value_bits == 1,
        value_bits=value_bits,
        key_per_token=key_per_token,
    )
    assert store.per_head_rows == (layout != "shared")
    assert layout == "shared" or store.index.encoding == layout
    return store


def queries(tq, hq, d=32, dtype=torch.float32, seed=1):
    return torch.randn(tq, hq, d, generator=torch.Generator().manual_seed(seed)).to(dtype)


def reference(store, q, scale=None):
    """fp32 attention over the store's dequantized rows."""
    from unicache_core.kv.attention import attention_with_lse

    k, v = store.dequantize(torch.float32)
    return attention_with_lse(q.float(), k, v, scale=scale)


def relative(got, want) -> float:
    """``max |got - want| / max |want|``."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


def layout_case(name):
    from unicache_core.kv.packed_attention_triton import packed_attention

    rows, bits, vbits, per_token, group, residual, layout, hq, tq, mag, d = LAYOUTS[name]
    store = make_store(
        rows,
        d=d,
        bits=bits,
        group=group,
        residual=residual,
        value_bits=vbits,
        key_per_token=per_token,
        layout=layout,
        magnitude=mag,
    )
    q = queries(tq, hq, d=d) / mag
    want_out, want_lse = reference(store, q)
    torch_out, torch_lse = store.attend(q)  # CPU queries: the torch path
    report = {
        "value_bits": store.value_bits,
        "key_per_token": store.key_per_token,
        "quantized": store.num_quantized,
        "scale_dtype": str(store.qkeys.scale.dtype),
        "per_head_rows": store.per_head_rows,
        "splits": {},
    }
    for splits in (None, 1):  # split over programs (8 off CUDA), and one program per KV head and query block
        out, lse = packed_attention(store, q, block_n=16, splits=splits)
        report["splits"][str(splits)] = {
            "dtype": str(out.dtype),
            "shape": list(out.shape),
            "lse_dtype": str(lse.dtype),
            "out": relative(out, want_out),
            "lse": relative(lse, want_lse),
            "out_vs_torch": relative(out, torch_out),
            "lse_vs_torch": relative(lse, torch_lse),
        }
    return report


def rows_case():
    """Which rows the kernel attends: at scale 0 every row weighs the same (the LSE is log(rows), the output their
    mean); a key the query matches strongly outweighs the others (the output is that row's value)."""
    from unicache_core.kv.packed_attention_triton import packed_attention

    report = {}
    for layout in ("shared", "bitmap"):
        store = make_store(77, residual=5, layout=layout)
        out, lse = packed_attention(store, queries(3, 4), scale=0.0, block_n=16, splits=3)
        _, v = store.dequantize(torch.float32)  # [T, Hkv, d]
        mean = v.mean(dim=0).repeat_interleave(2, dim=0)  # query head h reads KV head h // 2
        report[layout] = {
            "lse_minus_log_rows": float((lse - math.log(77)).abs().max()),
            "out_minus_mean": float((out - mean).abs().max()),
        }
    store = make_store(77, bits=8)
    k, v = store.dequantize(torch.float32)
    needle = []
    for row in (0, 16, 47, 76):
        out, _ = packed_attention(store, k[row].unsqueeze(0) * 50, block_n=16, splits=4)  # [1, Hq = Hkv, d]
        needle.append(float((out[0] - v[row]).abs().max()))
    report["needle"] = needle
    return report


def half_case(dtype):
    from unicache_core.kv.packed_attention_triton import packed_attention

    store = make_store(70, bits=4, residual=3, dtype=dtype)
    q = queries(5, 4, dtype=dtype)
    out, lse = packed_attention(store, q, block_n=16)
    torch_out, torch_lse = store.attend(q)
    want_out, want_lse = reference(store, q)
    return {
        "dtype": str(out.dtype),
        "eps": torch.finfo(dtype).eps,
        "out": relative(out, want_out),
        "lse": relative(lse, want_lse),
        "torch_out": relative(torch_out, want_out),
        "torch_lse": relative(torch_lse, want_lse),
        "out_vs_torch": relative(out, torch_out),
    }


def dispatch_case():
    """``QuantizedStore.attend`` with queries the selection takes for CUDA ones: the kernel runs, once per call."""
    from unicache_core.kv import packed_attention_triton as pat

    store = make_store(77, bits=4, residual=5, layout="bitmap")
    q = queries(2, 4)
    torch_out, torch_lse = store.attend(q)
    calls = []
    kernel = pat.packed_attention
    pat.packed_attention = lambda *a, **k: calls.append(1) or kernel(*a, **k)
    pat._on_cuda = lambda q: True
    out, lse = store.attend(q)
    with pat.kernel_disabled():
        store.attend(q)
    return {
        "kernel_calls": len(calls),
        "out_vs_torch": relative(out, torch_out),
        "lse_vs_torch": relative(lse, torch_lse),
    }


def fused_case():
    """``SegmentedLayer.attend(fused=True)`` (the calls that measure nothing) with queries taken for CUDA ones: the
    quantized stores go to the kernel, the others through the fused workspace, merged; against the torch path."""
    from unicache_core.kv import packed_attention_triton as pat
    from unicache_core.kv.quantized_store import QuantizedStore
    from unicache_core.kv.segmented_cache import SegmentedLayer
    from unicache_core.kv.stores import EvictedStore, FullStore
    from unicache_core.kv.token_types import TokenType

    gen = torch.Generator().manual_seed(5)
    k, v = torch.randn(120, 2, 32, generator=gen), torch.randn(120, 2, 32, generator=gen)
    k_new, v_new = torch.randn(6, 2, 32, generator=gen), torch.randn(6, 2, 32, generator=gen)
    pos = torch.arange(120)
    keep = torch.stack([torch.arange(0, 20, 2), torch.arange(1, 20, 2)])
    full = FullStore(k[:20], v[:20], pos[:20], TokenType.BOUNDARY)
    evicted = EvictedStore.from_selection(k[20:40], v[20:40], pos[20:40], keep, TokenType.SOURCE_VIT)
    vae = QuantizedStore.from_kv(k[40:90], v[40:90], pos[40:90], 2, 16, 4, TokenType.SOURCE_VAE)
    vit = QuantizedStore.from_kv(k[90:], v[90:], pos[90:], 4, 8, 0, TokenType.SOURCE_VIT, key_per_token=True)
    layers = {"mixed": [full, evicted, vae, vit], "quantized only": [vae, vit]}
    q = queries(6, 4)
    calls = []
    kernel = pat.packed_attention
    report = {}
    for name, stores in layers.items():
        layer = SegmentedLayer()
        layer.stores = stores
        for new in ({"k_new": k_new, "v_new": v_new, "causal": True}, {"k_new": k_new, "v_new": v_new}, {}):
            pat._on_cuda, pat.packed_attention = (lambda q: False), kernel
            want_out, want_lse = layer.attend(q, fused=True, **new)
            pat._on_cuda = lambda q: True
            pat.packed_attention = lambda *a, **kw: calls.append(1) or kernel(*a, **kw)
            out, lse = layer.attend(q, fused=True, **new)
            key = f"{name}, new block {'causal' if new.get('causal') else 'visible' if new else 'none'}"
            report[key] = {"out": relative(out, want_out), "lse": relative(lse, want_lse), "calls": len(calls)}
            calls.clear()
    pat._on_cuda, pat.packed_attention = (lambda q: False), kernel
    return report


def main(argv: list[str]) -> int:
    import triton

    from unicache_core.kv.packed_attention_triton import kernels

    torch.set_num_threads(1)
    start = time.perf_counter()
    report = {
        "interpret": bool(triton.knobs.runtime.interpret),
        "kernels_interpret": kernels().interpret,
        "triton": triton.__version__,
        "torch": torch.__version__,
    }
    report["layouts"] = {name: layout_case(name) for name in LAYOUTS}
    report["rows"] = rows_case()
    report["half"] = {str(dtype): half_case(dtype) for dtype in (torch.bfloat16, torch.float16)}
    report["fused"] = fused_case()
    report["dispatch"] = dispatch_case()
    report["seconds"] = time.perf_counter() - start
    with open(argv[0], "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
