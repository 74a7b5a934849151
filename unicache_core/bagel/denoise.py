"""From noise to an image (docs/bagel.md §5.3): CFG branch velocities, the guided velocity, the Euler loop, the decode.

Branches are computed as the official ``_forward_flow`` does: ``cfg_text`` only when the text scale
(after the interval test) is > 1, ``cfg_img`` only when the image scale is > 1 as well (when the text
scale is <= 1 the image term is never used, so it is not computed). Every branch velocity and the
guided velocity of every step are checked for non-finite values (:func:`~.numerics.check_velocities`).
With ``settings.taylorseer`` a branch's velocity is forecast on the steps :mod:`.taylorseer` does not compute
(its caches see no call in them; the step's :class:`~unicache_core.kv.cache.StepInfo` says which).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from PIL import Image
from torch import Tensor

from ..errors import CancelledError, NonFiniteKVError, NumericalError
from ..kv.cache import StepInfo
from ..kv.token_types import BRANCHES, THINK
from . import contexts as C
from .checkpoint.loader import LoadedBagel
from .contexts import GenerationContexts
from .modeling import AutoEncoder, vae_tiling
from .numerics import check_finite, check_velocities, model_advice
from .request import NO_HOOKS, RunHooks
from .sampling import cfg_active, combine_cfg, timestep_schedule, unpack_latent
from .settings import GenerationSettings
from .taylorseer import TaylorSeer
from .transforms import image_from_tensor

logger = logging.getLogger(__name__)

#: The classifier-free guidance branches a denoising step may compute (all but the think plan's).
CFG_BRANCHES = tuple(branch for branch in BRANCHES if branch != THINK)


def step_branches(t: Tensor, settings: GenerationSettings) -> tuple[list[str], float, float]:
    """``(branches computed at time t, text scale, image scale)`` as the official ``_forward_flow`` decides."""
    active = cfg_active(t, settings.cfg_interval)
    text_scale = settings.cfg_text_scale if active else 1.0
    img_scale = settings.cfg_img_scale if active else 1.0
    names = ["gen"]
    if text_scale > 1.0:
        names.append("cfg_text")
        if img_scale > 1.0:
            names.append("cfg_img")
    return names, text_scale, img_scale


@torch.inference_mode()
def branch_velocities(
    loaded: LoadedBagel,
    contexts: GenerationContexts,
    x: Tensor,
    t: Tensor | float,
    *,
    step: int = 0,
    branches: Sequence[str] = CFG_BRANCHES,
    seer: TaylorSeer | None = None,
) -> dict[str, Tensor]:
    """Raw velocities ``[h*w, 64]`` (model dtype) of the listed branches for latents ``x`` ``[h*w, 64]`` at ``t``.

    The query embeddings are built once and shared by every branch; each branch's latent block
    sits at its own context's rope. The branches run through the decoder together, layer by layer
    (:func:`~.contexts.latent_velocities`: one upcast or copy of each layer per step). Caches are not modified.
    With ``seer`` (TaylorSeer) the branches it forecasts at ``step`` are not run (:meth:`.TaylorSeer.velocities`).
    """
    lp = loaded.config.latent_downsample
    h, w = contexts.height // lp, contexts.width // lp
    timestep = float(t)
    by_name = contexts.branches()
    chosen = {name: by_name[name] for name in branches}
    if seer is not None:
        return seer.velocities(
            loaded, chosen, lambda: C.latent_block_embeds(loaded, x, h, w, timestep), step=step, timestep=timestep
        )
    embeds = C.latent_block_embeds(loaded, x, h, w, timestep)
    return C.latent_velocities(loaded, chosen, embeds, step=step, timestep=timestep)


@torch.inference_mode()
def guided_velocity(
    loaded: LoadedBagel,
    contexts: GenerationContexts,
    x: Tensor,
    t: Tensor | float,
    settings: GenerationSettings,
    *,
    step: int = 0,
    seer: TaylorSeer | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Guided velocity ``[h*w, 64]`` of one denoising step and the raw branch velocities it used (``seer``: the
    request's TaylorSeer, which forecasts some of them)."""
    t_tensor = t if isinstance(t, Tensor) else torch.tensor(t, dtype=torch.float32)
    names, text_scale, img_scale = step_branches(t_tensor, settings)
    raw = branch_velocities(loaded, contexts, x, t_tensor, step=step, branches=names, seer=seer)
    guided = combine_cfg(
        raw["gen"],
        raw.get("cfg_text"),
        raw.get("cfg_img"),
        text_scale=text_scale,
        img_scale=img_scale,
        renorm_type=settings.cfg_renorm_type,
        renorm_min=settings.cfg_renorm_min,
    )
    return guided, raw


@dataclass(frozen=True)
class Denoised:
    """What :func:`denoise` returns.

    Attributes:
        latent: the final latent ``x0`` ``[h*w, 64]`` fp32 (packed).
        forwards: decoder forwards per CFG branch (the steps that ran its decoder).
        forecasts: with TaylorSeer, the steps that forecast each branch instead (None without TaylorSeer).
        peak_factor_bytes: with TaylorSeer, the most bytes its Taylor factors held (None without).
        step0_velocity: with ``return_step0_velocity``: the branch velocities computed at step 0 and ``guided``,
            ``[h*w, 64]`` each (None otherwise).
    """

    latent: Tensor
    forwards: dict[str, int]
    forecasts: dict[str, int] | None = None
    peak_factor_bytes: int | None = None
    step0_velocity: dict[str, Tensor] | None = None


def _preview(loaded: LoadedBagel, contexts: GenerationContexts, x: Tensor, t: Tensor, v: Tensor) -> Tensor:
    """The live preview's image of a step: the flow's estimate of the clean latent ``x0 = x_t - t * v``
    (``x``, ``v``: ``[h*w, 64]``) unpacked to ``[1, 16, H/8, W/8]`` (BAGEL's convention)."""
    cfg = loaded.config
    lp = cfg.latent_downsample
    estimate = x.float() - float(t) * v.to(x.device).float()
    return unpack_latent(
        estimate, contexts.height // lp, contexts.width // lp, cfg.latent_channel, cfg.latent_patch_size
    )


def _step_info(seer: TaylorSeer | None, step: int, total: int, names: list[str], timestep: Tensor) -> StepInfo:
    """What the caches' session is told of denoising step ``step``: the branches it computes (``names``) and, with
    TaylorSeer, those it forecasts and the next step that computes them all."""
    return StepInfo(
        phase="denoise",
        step=step,
        total=total,
        branches=tuple(names),
        timestep=float(timestep),
        forecast=() if seer is None else seer.forecast_branches(step, names),
        next_full=None if seer is None else seer.next_full(step, names),
    )


@torch.inference_mode()
def denoise(
    loaded: LoadedBagel,
    contexts: GenerationContexts,
    x: Tensor,
    settings: GenerationSettings,
    *,
    hooks: RunHooks = NO_HOOKS,
    return_step0_velocity: bool = False,
) -> Denoised:
    """Euler flow from noise ``x`` ``[h*w, 64]`` (fp32): ``x -= v * dt`` for ``num_timesteps - 1`` steps.

    ``hooks``: cancel polled before each step, progress and ``steer`` (the next latent) after it, and
    ``preview(done, total, x0)`` with the flow's current estimate of the clean latent, ``x0 = x_t - t * v``
    unpacked to ``[1, 16, H/8, W/8]`` (BAGEL's convention), for a live preview.

    With ``settings.taylorseer`` only the steps :mod:`.taylorseer` computes run a branch's decoder; the result
    counts the steps that forecast each branch instead and the most bytes the Taylor factors held
    (:class:`Denoised`).
    """
    timesteps, dts = timestep_schedule(settings.num_timesteps, settings.timestep_shift)
    total = len(timesteps)
    forwards = dict.fromkeys(CFG_BRANCHES, 0)
    forecast_counts = dict.fromkeys(CFG_BRANCHES, 0)
    computed = [step_branches(t, settings)[0] for t in timesteps]  # the branches each step computes
    seer = TaylorSeer.for_settings(settings, computed)
    step0 = None
    for i in range(total):
        if hooks.cancelled():
            raise CancelledError(f"denoising cancelled before step {i + 1} of {total}")
        info = _step_info(seer, i, total, computed[i], timesteps[i])
        if contexts.session is not None:
            contexts.session.begin_step(info)
        try:
            v, raw = guided_velocity(loaded, contexts, x, timesteps[i], settings, step=i, seer=seer)
        except NonFiniteKVError as exc:  # the step's own non-finite values, not a fault of the KV quantizer
            raise NumericalError(
                f"denoising step {i + 1} of {total}: the keys/values the model computed hold {exc.count} non-finite "
                f"(NaN/inf) values, which no KV cache can keep; {model_advice(loaded.dtype)}"
            ) from None
        finally:
            if contexts.session is not None:
                contexts.session.end_step(info)
        check_velocities(
            raw,
            v,
            step=i,
            total=total,
            dtype=loaded.dtype,
            cfg_text_scale=settings.cfg_text_scale,
            cfg_img_scale=settings.cfg_img_scale,
        )
        for name in raw:
            (forecast_counts if name in info.forecast else forwards)[name] += 1
        if i == 0 and return_step0_velocity:
            step0 = {**raw, "guided": v}
        if hooks.preview is not None:
            hooks.preview(i + 1, total, _preview(loaded, contexts, x, timesteps[i], v))
        # Official order: the velocity (model dtype) times the fp32 0-dim dt stays in the velocity
        # dtype, then it is subtracted from the fp32 latent.
        x = hooks.steered(i, v, x - v.to(x.device) * dts[i].to(x.device))
        hooks.report(i + 1, total)
    if seer is not None:
        logger.info(
            "TaylorSeer: decoder forwards %s, forecast %s of %d steps (factors peaked at %d bytes)",
            forwards,
            forecast_counts,
            total,
            seer.peak_bytes,
        )
        return Denoised(x, forwards, forecast_counts, seer.peak_bytes, step0)
    return Denoised(x, forwards, step0_velocity=step0)


@torch.inference_mode()
def decode_latents(
    loaded: LoadedBagel, x: Tensor, height: int, width: int, vae=None
) -> tuple[Tensor, Image.Image | None]:
    """Packed ``[h*w, 64]`` → ``([1, 16, 2h, 2w] latent, PIL image)`` through ``vae`` (no image when None).

    ``vae``: the checkpoint's :class:`~.modeling.AutoEncoder` (runs in fp32) or an external
    :class:`~.latents.VAEAdapter` (gets the latent as CPU fp32 and must return ``[1, 3, H, W]``).
    """
    cfg = loaded.config
    h, w = height // cfg.latent_downsample, width // cfg.latent_downsample
    latent = unpack_latent(x.float(), h, w, cfg.latent_channel, cfg.latent_patch_size)
    check_finite(latent, "the final latent", model_advice(loaded.dtype))
    if vae is None:
        return latent, None
    if isinstance(vae, AutoEncoder):
        pixels = _decode_whole_or_tiled(vae, latent.to(C.vae_device(loaded, vae)))
        advice = "check ae.safetensors (re-download it); the VAE always runs in fp32"
    else:
        pixels = vae.decode(latent.detach().cpu().clone())
        if (
            not isinstance(pixels, Tensor)
            or not pixels.is_floating_point()
            or tuple(pixels.shape) != (1, 3, height, width)
        ):
            got = tuple(pixels.shape) if isinstance(pixels, Tensor) else type(pixels).__name__
            raise ValueError(
                f"the external VAE's decode must return a float tensor of shape "
                f"{(1, 3, height, width)} in [-1, 1], got {got}"
            )
        advice = "check the external VAE (its decode returned non-finite pixels)"
    check_finite(pixels, "the decoded image (VAE output, before the uint8 conversion)", advice)
    return latent, image_from_tensor(pixels)


def _decode_whole_or_tiled(vae: AutoEncoder, latent: Tensor) -> Tensor:
    """``vae.decode(latent)``; when the device runs out of memory for it, the decode in overlapping tiles
    (:mod:`.modeling.vae_tiling`, ComfyUI's fallback too), which holds a fraction of it and blends the seams."""
    try:
        return vae.decode(latent)
    except torch.OutOfMemoryError:
        pass  # retried below, once the failed attempt's tensors (held by the exception's frames) are gone
    if latent.device.type == "cuda":
        torch.cuda.empty_cache()
    height, width = (size * vae.config.downsample for size in latent.shape[2:])
    logger.warning(
        "the VAE decode of the %dx%d image ran out of device memory: decoding it in overlapping tiles "
        "(close to the whole decode, not equal; docs in unicache_core/bagel/modeling/vae_tiling.py)",
        width,
        height,
    )
    return vae_tiling.decode_tiled(vae, latent, vae_tiling.TILE_CELLS, vae_tiling.OVERLAP_CELLS)


__all__ = ["CFG_BRANCHES", "branch_velocities", "decode_latents", "denoise", "guided_velocity", "step_branches"]
