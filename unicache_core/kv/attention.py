"""Exact attention primitives over packed KV, with log-sum-exp so partial results can be merged.

Layout everywhere is BAGEL's packed layout: queries ``[Tq, Hq, d]``, keys/values ``[Tk, Hkv, d]``
with grouped-query attention (query head ``h`` reads KV head ``h // (Hq // Hkv)``).

Attention over a context split into parts (cached segments, compacted or quantized stores, the new
block) is computed part by part and merged exactly::

    lse = logsumexp_s(lse_s);  out = sum_s exp(lse_s - lse) * out_s
"""

from __future__ import annotations

import logging
import math

import torch
from torch import Tensor

from ..validation import check_int

logger = logging.getLogger(__name__)

_cpu_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _check_gqa(q: Tensor, k: Tensor, v: Tensor) -> int:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"attention expects q [Tq, Hq, d], k/v [Tk, Hkv, d]; got shapes {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"keys {tuple(k.shape)} and values {tuple(v.shape)} must have the same shape")
    hq, hkv = q.shape[1], k.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"head dim of queries ({q.shape[2]}) and keys ({k.shape[2]}) differ")
    return hq // hkv


def _uses_cpu_flash(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether :func:`_head_major_attention` (no mask) dispatches to the CPU flash kernel."""
    return (
        q.device.type == "cpu"
        and _cpu_flash is not None
        and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and k.dtype == q.dtype
        and v.dtype == q.dtype
    )


def _head_major_attention(
    q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, mask: Tensor | None
) -> tuple[Tensor, Tensor]:
    """q ``[B, Tq, d]``, k/v ``[B, Tk, d]`` (B = heads) → out ``[B, Tq, d]``, lse ``[B, Tq]`` fp32."""
    if k.shape[1] == 0:
        out = q.new_zeros(q.shape)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        return out, lse
    if mask is None and _cpu_flash is not None and _uses_cpu_flash(q, k, v):
        out, lse = _cpu_flash(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), 0.0, causal, scale=scale)
        return out.squeeze(0), lse.squeeze(0).float()
    if mask is None and q.is_cuda and k.dtype == q.dtype and v.dtype == q.dtype:
        fused = _cuda_fused_attention(q, k, v, scale, causal)
        if fused is not None:
            return fused
    return _reference_attention(q, k, v, scale, causal, mask)


_CUDA_FUSED_FAILED: set[tuple] = set()


def _cuda_fused_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor] | None:
    """Fused CUDA attention that also returns the LSE (flash for fp16/bf16, memory-efficient otherwise).

    q ``[B, Tq, d]``, k/v ``[B, Tk, d]`` → out ``[B, Tq, d]``, lse ``[B, Tq]`` fp32; ``None`` when the kernels
    refuse this shape/dtype (the exact chunked reference then runs; logged once per shape class).
    ``causal`` is only used with ``Tq == Tk`` (top-left and bottom-right alignment coincide).
    """
    key = (q.dtype, q.shape[-1], q.device)
    if key in _CUDA_FUSED_FAILED:
        return None
    qq, kk, vv = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    try:
        if q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:
            res = torch.ops.aten._scaled_dot_product_flash_attention(qq, kk, vv, 0.0, causal, False, scale=scale)
        else:
            res = torch.ops.aten._scaled_dot_product_efficient_attention(
                qq, kk, vv, None, True, 0.0, causal, scale=scale
            )
    except (RuntimeError, NotImplementedError, AttributeError) as exc:
        _CUDA_FUSED_FAILED.add(key)
        logger.info(
            "fused CUDA attention unavailable for %s head dim %d (%s); using the chunked reference",
            q.dtype,
            q.shape[-1],
            str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
        )
        return None
    out, lse = res[0], res[1]
    return out.squeeze(0), lse.squeeze(0)[..., : q.shape[1]].float()


#: Score elements (fp32) the reference path materialises at once; queries are processed in chunks
#: so that e.g. a 4098-query latent block over a 13K-token edit context never needs GBs of scores.
REFERENCE_SCORE_ELEMENTS = 1 << 25


def _reference_attention(
    q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, mask: Tensor | None
) -> tuple[Tensor, Tensor]:
    """fp32 math on any device, chunked over queries; ``mask`` is ``[Tq, Tk]`` bool (True = visible)."""
    b, tq, _ = q.shape
    tk = k.shape[1]
    rows = max(1, REFERENCE_SCORE_ELEMENTS // max(1, b * tk))
    kf, vf = k.float(), v.float()
    outs, lses = [], []
    for start in range(0, tq, rows):
        stop = min(tq, start + rows)
        scores = torch.matmul(q[:, start:stop].float(), kf.transpose(-1, -2)) * scale
        if causal:
            # bottom-right aligned: query i sees keys 0 .. tk - tq + i
            visible = torch.arange(tk, device=q.device)[None, :] <= (
                torch.arange(start, stop, device=q.device)[:, None] + (tk - tq)
            )
            scores = scores.masked_fill(~visible, float("-inf"))
        if mask is not None:
            scores = scores.masked_fill(~mask[start:stop], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse.unsqueeze(-1).clamp_min(torch.finfo(torch.float32).min))
        probs = torch.nan_to_num(probs, nan=0.0)
        outs.append(torch.matmul(probs, vf).to(q.dtype))
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


def block_causal_mask(
    lengths: list[int] | tuple[int, ...],
    causal: list[bool] | tuple[bool, ...],
    device: torch.device | str | None = None,
) -> Tensor:
    """Visibility ``[T, T]`` bool (True = visible) of a packed sequence of blocks, as BAGEL packs them.

    Block ``i`` sees every earlier block fully; inside itself it is causal (text) when ``causal[i]``,
    else bidirectional (an image block). ``T = sum(lengths)``.
    """
    if len(lengths) != len(causal):
        raise ValueError(f"`lengths` ({len(lengths)}) and `causal` ({len(causal)}) must have one entry per block")
    for i, n in enumerate(lengths):
        check_int(f"lengths[{i}]", n, 0)
    total = sum(lengths)
    mask = torch.zeros(total, total, dtype=torch.bool, device=device)
    start = 0
    for n, is_causal in zip(lengths, causal):
        stop = start + n
        mask[start:stop, :start] = True
        block = torch.ones(n, n, dtype=torch.bool, device=device)
        mask[start:stop, start:stop] = block.tril() if is_causal else block
        start = stop
    return mask


def attention_with_lse(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of packed queries over packed keys/values, returning the log-sum-exp too.

    Args:
        q: ``[Tq, Hq, d]`` queries.
        k, v: ``[Tk, Hkv, d]`` keys and values; ``Hq`` must be a multiple of ``Hkv`` (GQA).
        scale: softmax scale, default ``1/sqrt(d)``.
        causal: bottom-right aligned causal mask (query ``i`` sees keys ``0 .. Tk-Tq+i``), as
            flash-attn >= 2.1 applies it. ``False`` = every query sees every key.
        mask: optional ``[Tq, Tk]`` bool visibility (True = visible), e.g. :func:`block_causal_mask`
            for a packed text+image block; combined with ``causal`` when both are given.

    Returns:
        ``out [Tq, Hq, d]`` in ``q.dtype`` and ``lse [Tq, Hq]`` in fp32 (``-inf`` for rows that see no key).
    """
    group = _check_gqa(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    tq, hq, d = q.shape
    hkv = k.shape[1]
    kh = k.permute(1, 0, 2)  # [Hkv, Tk, d]
    vh = v.permute(1, 0, 2)
    if mask is not None:
        if mask.dtype != torch.bool or tuple(mask.shape) != (tq, k.shape[0]):
            raise ValueError(
                f"`mask` must be a bool tensor of shape ({tq}, {k.shape[0]}), got {mask.dtype} {tuple(mask.shape)}"
            )
        visible = mask.to(q.device)
        if causal:
            visible = visible & torch.ones(tq, k.shape[0], dtype=torch.bool, device=q.device).tril(k.shape[0] - tq)
        qh = q.permute(1, 0, 2)
        if group > 1:
            kh, vh = kh.repeat_interleave(group, dim=0), vh.repeat_interleave(group, dim=0)
        out, lse = _head_major_attention(qh, kh, vh, scale, False, visible)
        return out.permute(1, 0, 2), lse.permute(1, 0)
    if not causal or (tq <= k.shape[0] and tq == 1):
        # Fold the g query heads of a KV group into the query axis: [Hkv, g*Tq, d].
        qg = q.reshape(tq, hkv, group, d).permute(1, 2, 0, 3).reshape(hkv, group * tq, d)
        if _uses_cpu_flash(q, k, v) and tq > 1:
            # The CPU flash kernel streams each head's keys; on packed [Tk, Hkv, d] rows (stride Hkv*d)
            # it is measurably slower than on a head-major copy, copy included (~5-7% at 2.5K-19K keys,
            # bf16, 256 queries; benchmarks/kv_attention.py). Same values, same order: exact.
            kh = kh.contiguous()
            vh = vh.contiguous()
        out, lse = _head_major_attention(qg, kh, vh, scale, False, None)
        out = out.reshape(hkv, group, tq, d).permute(2, 0, 1, 3).reshape(tq, hq, d)
        lse = lse.reshape(hkv, group, tq).permute(2, 0, 1).reshape(tq, hq)
        return out, lse
    # Causal with several queries: expand KV heads so each query head has its own rows.
    qh = q.permute(1, 0, 2)  # [Hq, Tq, d]
    if group > 1:
        kh = kh.repeat_interleave(group, dim=0)
        vh = vh.repeat_interleave(group, dim=0)
    if tq == k.shape[0]:
        out, lse = _head_major_attention(qh, kh, vh, scale, True, None)
    else:
        tk = k.shape[0]
        visible = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(diagonal=tk - tq)
        out, lse = _head_major_attention(qh, kh, vh, scale, False, visible)
    return out.permute(1, 0, 2), lse.permute(1, 0)


def merge_attention(parts: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Exactly merge partial attentions computed over disjoint key sets.

    Args:
        parts: ``(out [Tq, Hq, d], lse [Tq, Hq])`` pairs over the same queries.

    Returns:
        The merged ``(out [Tq, Hq, d], lse [Tq, Hq])``; ``out`` keeps the dtype of the first part.
    """
    if not parts:
        raise ValueError("merge_attention needs at least one part")
    if len(parts) == 1:
        return parts[0]
    lses = torch.stack([lse for _, lse in parts])  # [S, Tq, Hq]
    total = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - total.clamp_min(torch.finfo(torch.float32).min).unsqueeze(0))
    weights = torch.nan_to_num(weights, nan=0.0)
    out = parts[0][0].float() * weights[0].unsqueeze(-1)
    for (part_out, _), w in zip(parts[1:], weights[1:]):
        out.add_(part_out.float() * w.unsqueeze(-1))
    return out.to(parts[0][0].dtype), total
