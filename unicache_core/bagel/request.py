"""What a caller hands to one request besides its prompt, image and settings: run-time hooks and given latents."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import Tensor

#: ``progress(done, total)``: called after every decoded token (understanding; in think mode first for
#: the plan tokens, ``total = think_max_new_tokens``) and after every denoising step (``total = steps``).
ProgressFn = Callable[[int, int], None]
#: ``cancel()``: polled before every decoded token and denoising step; True raises ``CancelledError``.
CancelFn = Callable[[], bool]
#: ``preview(done, total, x0)``: the current clean-latent estimate ``[1, 16, H/8, W/8]`` after each denoising step.
PreviewFn = Callable[[int, int, Tensor], None]


@dataclass(frozen=True)
class RunHooks:
    """Callbacks of one request (each optional): progress, cancellation, live preview."""

    progress: ProgressFn | None = None
    cancel: CancelFn | None = None
    preview: PreviewFn | None = None

    def cancelled(self) -> bool:
        return self.cancel is not None and bool(self.cancel())

    def report(self, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(done, total)


NO_HOOKS = RunHooks()


@dataclass(frozen=True)
class GivenLatents:
    """Latents a generation uses instead of drawing or encoding them (each optional; shapes are checked).

    Attributes:
        initial_noise: ``[h*w, 64]`` packed latent noise the flow starts from (else drawn from the seed).
        vae_noise: ``[1, 16, H/8, W/8]`` sampling noise of the built-in VAE's encode of an edit's source.
        source_latent: an edit's source latent ``[1, 16, H/8, W/8]`` in BAGEL's convention (e.g.
            :func:`~.latents.from_comfy_latent` of ComfyUI's ``VAEEncode``); the encode is skipped. Any size on
            BAGEL's grid (even cell counts, at most 128 per side): the output is ``W x H`` and the ViT sees the
            image resized to it (:func:`~.settings.source_latent_size`).
    """

    initial_noise: Tensor | None = None
    vae_noise: Tensor | None = None
    source_latent: Tensor | None = None


NO_GIVEN_LATENTS = GivenLatents()

__all__ = ["CancelFn", "GivenLatents", "NO_GIVEN_LATENTS", "NO_HOOKS", "PreviewFn", "ProgressFn", "RunHooks"]
