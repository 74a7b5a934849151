"""Pure sampling math of BAGEL: flow schedule, CFG combination, latent packing, token sampling.

No model here; every function is deterministic given its inputs (docs/bagel.md §5.2-§5.3, §2.7).
The arithmetic follows the official operation order and dtypes so that results match bit for bit
when the inputs do (e.g. the schedule is fp32, the CFG math runs in the velocity's dtype, and the
interval test compares fp32 tensors, so ``t = fp32(0.4)`` is *not* inside ``(0.4, 1.0]``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..validation import check_float, check_int

#: Allowed ``cfg_renorm_type`` values.
RENORM_TYPES: tuple[str, ...] = ("global", "channel", "text_channel")


def timestep_schedule(num_timesteps: int, shift: float) -> tuple[Tensor, Tensor]:
    """Shifted flow schedule.

    ``t = linspace(1, 0, num_timesteps)``; ``t = shift*t / (1 + (shift-1)*t)``.

    Returns:
        ``(timesteps [num_timesteps-1], dts [num_timesteps-1])`` fp32: the times at which the model
        is evaluated (first ``num_timesteps-1`` points) and ``dt_i = t_i - t_{i+1}``.
    """
    check_int("num_timesteps", num_timesteps, 2)
    check_float("timestep_shift", shift, 0.0, strict=True)
    t = torch.linspace(1, 0, int(num_timesteps))
    t = shift * t / (1 + (shift - 1) * t)
    return t[:-1], t[:-1] - t[1:]


def cfg_active(t: Tensor, interval: tuple[float, float]) -> bool:
    """``interval[0] < t <= interval[1]`` evaluated as the official code does (fp32 tensor compare)."""
    return bool(t > interval[0]) and bool(t <= interval[1])


def guidance_weights(text_scale: float, img_scale: float) -> tuple[tuple[str, float], ...]:
    """Each branch's coefficient in the guided velocity of :func:`combine_cfg` before its renorm:
    ``s_i * s_t * v + s_i * (1 - s_t) * v_text + (1 - s_i) * v_img`` with both scales active (an edit at 4 and 2:
    8, -6, -1), ``s_t * v + (1 - s_t) * v_text`` with text guidance only, ``v`` without guidance. The renorm scales
    the guided velocity (or its text part) as a whole, so it leaves the branches' shares of its error unchanged
    (the compression's branch weights, docs/compression.md §11.8)."""
    if not text_scale > 1.0:
        return (("gen", 1.0),)
    if not img_scale > 1.0:
        return (("gen", text_scale), ("cfg_text", 1.0 - text_scale))
    return (("gen", img_scale * text_scale), ("cfg_text", img_scale * (1.0 - text_scale)), ("cfg_img", 1.0 - img_scale))


def combine_cfg(
    v: Tensor,
    v_text: Tensor | None,
    v_img: Tensor | None,
    *,
    text_scale: float,
    img_scale: float,
    renorm_type: str = "global",
    renorm_min: float = 0.0,
) -> Tensor:
    """Classifier-free guidance of the three branch velocities (docs/bagel.md §5.3 step 4).

    Args:
        v: ``[N, 64]`` velocity of the full (``gen``) context.
        v_text: ``[N, 64]`` velocity without the text (``cfg_text``); only read when ``text_scale > 1``.
        v_img: ``[N, 64]`` velocity without the image (``cfg_img``); only read when both scales > 1.
        text_scale, img_scale: guidance scales (``<= 1`` disables that term).
        renorm_type: ``"global"`` (one norm over all elements), ``"channel"`` (per token), or
            ``"text_channel"`` (per-token renorm of the text term only, before the image term).
        renorm_min: lower clamp of the renorm factor (upper clamp is 1).

    Returns:
        ``[N, 64]`` guided velocity (``v`` itself when ``text_scale <= 1``).
    """
    if renorm_type not in RENORM_TYPES:
        raise ValueError(f"`cfg_renorm_type` must be one of {RENORM_TYPES}, got {renorm_type!r}")
    if not text_scale > 1.0:
        return v
    if v_text is None or (img_scale > 1.0 and v_img is None):
        raise ValueError("combine_cfg needs `v_text` (and `v_img` when img_scale > 1) for active guidance")
    # set exactly when image guidance is active (checked just above)
    img_guide = v_img if img_scale > 1.0 else None
    guided_text = v_text + text_scale * (v - v_text)
    if renorm_type == "text_channel":
        norm_v = torch.norm(v, dim=-1, keepdim=True)
        norm_g = torch.norm(guided_text, dim=-1, keepdim=True)
        guided_text = guided_text * (norm_v / (norm_g + 1e-8)).clamp(min=renorm_min, max=1.0)
        if img_guide is not None:
            return img_guide + img_scale * (guided_text - img_guide)
        return guided_text
    guided = img_guide + img_scale * (guided_text - img_guide) if img_guide is not None else guided_text
    if renorm_type == "global":
        norm_v, norm_g = torch.norm(v), torch.norm(guided)
    else:
        norm_v = torch.norm(v, dim=-1, keepdim=True)
        norm_g = torch.norm(guided, dim=-1, keepdim=True)
    return guided * (norm_v / (norm_g + 1e-8)).clamp(min=renorm_min, max=1.0)


def pack_latent(latent: Tensor, patch: int = 2) -> Tensor:
    """``[C, 2h, 2w]`` latent image → ``[h*w, patch*patch*C]`` tokens, features ordered ``(pr, pc, c)``."""
    if latent.dim() != 3 or latent.shape[1] % patch or latent.shape[2] % patch:
        raise ValueError(f"`latent` must be [C, H, W] with H, W multiples of {patch}, got {tuple(latent.shape)}")
    c, hh, ww = latent.shape
    h, w = hh // patch, ww // patch
    tokens = latent.reshape(c, h, patch, w, patch).permute(1, 3, 2, 4, 0)  # (h, w, pr, pc, c)
    return tokens.reshape(h * w, patch * patch * c)


def unpack_latent(tokens: Tensor, h: int, w: int, channels: int = 16, patch: int = 2) -> Tensor:
    """Inverse of :func:`pack_latent`: ``[h*w, patch*patch*C]`` → ``[1, C, patch*h, patch*w]``."""
    if tokens.shape != (h * w, patch * patch * channels):
        raise ValueError(
            f"`tokens` must have shape {(h * w, patch * patch * channels)} for a {h}x{w} token grid, "
            f"got {tuple(tokens.shape)}"
        )
    grid = tokens.reshape(1, h, w, patch, patch, channels).permute(0, 5, 1, 3, 2, 4)  # n c h p w q
    return grid.reshape(1, channels, h * patch, w * patch)


def next_token(logits: Tensor, *, do_sample: bool, temperature: float, generator: torch.Generator | None) -> int:
    """Greedy argmax, or a multinomial draw from ``softmax(logits / temperature)``; ``logits`` ``[V]``."""
    if not do_sample:
        return int(torch.argmax(logits, dim=-1))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs.cpu(), num_samples=1, generator=generator))
