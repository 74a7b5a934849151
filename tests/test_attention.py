"""attention_with_lse / merge_attention: layout independence of the CPU fast path, exactness vs fp32 math."""

from __future__ import annotations

import pytest
import torch

from unicache_core.kv.attention import attention_with_lse, merge_attention


def _reference(q, k, v):
    g = q.shape[1] // k.shape[1]
    scores = torch.einsum("qhd,thd->hqt", q.float(), k.float().repeat_interleave(g, 1)) / q.shape[-1] ** 0.5
    lse = torch.logsumexp(scores, -1)
    out = torch.einsum("hqt,thd->qhd", scores.softmax(-1), v.float().repeat_interleave(g, 1))
    return out, lse.t()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_and_head_major_kv_give_identical_results(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(12, 8, 32, generator=gen).to(dtype)
    k = torch.randn(300, 2, 32, generator=gen).to(dtype)
    v = torch.randn(300, 2, 32, generator=gen).to(dtype)
    out, lse = attention_with_lse(q, k, v)  # packed [Tk, Hkv, d]
    kh = k.transpose(0, 1).contiguous().transpose(0, 1)  # same values stored head-major
    vh = v.transpose(0, 1).contiguous().transpose(0, 1)
    out_h, lse_h = attention_with_lse(q, kh, vh)
    assert torch.equal(out, out_h) and torch.equal(lse, lse_h)
    ref_out, ref_lse = _reference(q, k, v)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.float(), ref_out, atol=tol, rtol=tol)
    assert torch.allclose(lse, ref_lse, atol=1e-4 if dtype == torch.float32 else 2e-2)


def test_split_and_merge_equals_whole() -> None:
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(5, 4, 16, generator=gen)
    k = torch.randn(50, 2, 16, generator=gen)
    v = torch.randn(50, 2, 16, generator=gen)
    whole = attention_with_lse(q, k, v)
    parts = [attention_with_lse(q, k[a:b], v[a:b]) for a, b in ((0, 7), (7, 31), (31, 50))]
    out, lse = merge_attention(parts)
    assert torch.allclose(out, whole[0], atol=1e-5) and torch.allclose(lse, whole[1], atol=1e-5)


@pytest.mark.parametrize("causal,tq,tk", [(False, 37, 90), (True, 37, 90), (True, 20, 20)])
def test_reference_path_is_chunked_and_exact(monkeypatch, causal, tq, tk) -> None:
    """The device-agnostic fp32 path processes queries in chunks (bounded score memory) with the same result."""
    import unicache_core.kv.attention as attention

    gen = torch.Generator().manual_seed(5)
    q = torch.randn(tq, 6, 16, generator=gen)
    k = torch.randn(tk, 2, 16, generator=gen)
    v = torch.randn(tk, 2, 16, generator=gen)
    fast_out, fast_lse = attention_with_lse(q, k, v, causal=causal)  # CPU flash kernel (or masked reference)
    monkeypatch.setattr(attention, "_uses_cpu_flash", lambda *a: False)  # as on a non-CPU device
    calls = []
    real = attention._reference_attention

    def spy(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(attention, "_reference_attention", spy)
    monkeypatch.setattr(attention, "REFERENCE_SCORE_ELEMENTS", 3 * 6 * tk)  # a few query rows per chunk
    out, lse = attention_with_lse(q, k, v, causal=causal)
    assert calls, "reference path not used"
    torch.testing.assert_close(out, fast_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, fast_lse, rtol=1e-5, atol=1e-5)
    ref_out, ref_lse = _reference(q, k, v) if not causal else (None, None)
    if ref_out is not None:
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)


def test_block_causal_mask_layout() -> None:
    from unicache_core.kv.attention import block_causal_mask

    mask = block_causal_mask([2, 3, 1], [True, False, True])
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 1, 1, 0],  # image block: sees the text before it and all of itself
            [1, 1, 1, 1, 1, 0],
            [1, 1, 1, 1, 1, 0],
            [1, 1, 1, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)
    with pytest.raises(ValueError, match="lengths"):
        block_causal_mask([2, -1], [True, False])
    with pytest.raises(ValueError, match="one entry per block"):
        block_causal_mask([2], [True, False])


def test_masked_attention_equals_reference_and_rejects_bad_masks() -> None:
    gen = torch.Generator().manual_seed(9)
    q, k, v = (
        torch.randn(5, 4, 8, generator=gen),
        torch.randn(7, 2, 8, generator=gen),
        torch.randn(7, 2, 8, generator=gen),
    )
    mask = torch.rand(5, 7, generator=gen) > 0.4
    mask[:, 0] = True
    out, lse = attention_with_lse(q, k, v, mask=mask)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = torch.einsum("qhd,thd->hqt", q, kk) / 8**0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    ref = torch.einsum("hqt,thd->qhd", scores.softmax(-1), vv)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1).t(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="mask"):
        attention_with_lse(q, k, v, mask=mask.float())
    with pytest.raises(ValueError, match="mask"):
        attention_with_lse(q, k, v, mask=mask[:, :3])
