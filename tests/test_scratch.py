"""Scratch buffers (unicache_core/kv/scratch.py): reused per purpose, valid in and out of inference mode."""

from __future__ import annotations

import torch

from unicache_core.kv import scratch as scratch_module
from unicache_core.kv.quant import quantize_keys
from unicache_core.kv.scratch import scratch


def test_a_buffer_made_under_inference_mode_is_written_outside_it() -> None:
    scratch_module.release()
    with torch.inference_mode():
        first = scratch("test.mode", (4, 8), torch.float32, torch.device("cpu"))
        first.fill_(1.0)
    again = scratch("test.mode", (4, 8), torch.float32, torch.device("cpu"))
    again.fill_(2.0)  # raised "Inplace update to inference tensor outside InferenceMode" before the fix
    assert again.data_ptr() == first.data_ptr()
    assert bool((again == 2.0).all())


def test_purposes_do_not_share_a_buffer_and_growth_reallocates() -> None:
    scratch_module.release()
    a = scratch("test.a", (16,), torch.float32, torch.device("cpu"))
    b = scratch("test.b", (16,), torch.float32, torch.device("cpu"))
    assert a.data_ptr() != b.data_ptr()
    grown = scratch("test.a", (1024,), torch.float32, torch.device("cpu"))
    assert grown.numel() == 1024
    assert scratch("test.a", (8, 2), torch.float32, torch.device("cpu")).data_ptr() == grown.data_ptr()


def test_packed_keys_dequantize_inside_then_outside_inference_mode() -> None:
    """The failure CI met: a store read under inference mode (a node's run) and then by a test outside it."""
    scratch_module.release()
    keys = torch.randn(2, 64, 8)
    packed = quantize_keys(keys, bits=4, group_size=32)
    with torch.inference_mode():
        inside = packed.dequantize(torch.float32).clone()
    outside = packed.dequantize(torch.float32)
    assert torch.equal(inside, outside)
    assert float((outside - keys).abs().max()) < 0.5
