"""What a caller hands to one request besides its prompt, image and settings: run-time hooks and given latents."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from torch import Tensor

_Next = TypeVar("_Next", Tensor, int)

#: ``progress(done, total)``: called after every decoded token (understanding; in think mode first for
#: the think tokens, ``total = think_max_new_tokens``) and after every denoising step (``total = steps``).
ProgressFn = Callable[[int, int], None]
#: ``cancel()``: polled before every decoded token and denoising step; True raises ``CancelledError``.
CancelFn = Callable[[], bool]
#: ``preview(done, total, x0)``: the current clean-latent estimate ``[1, 16, H/8, W/8]`` after each denoising step.
PreviewFn = Callable[[int, int, Tensor], None]
#: ``steer(step, output, proposed) -> next``: after every denoising step (``output`` the guided velocity
#: ``[h*w, 64]``, ``proposed`` the next latent ``[h*w, 64]`` fp32) and every decoded token, a think text's included
#: (``output`` the logits ``[vocab]``, ``proposed`` the next token id): what the loop continues from. Returning
#: ``proposed`` observes a run; returning another run's recorded value forces this one along that run's path
#: (teacher forcing: the quality benchmark measures a compressed cache's outputs on full KV's path with it).
SteerFn = Callable[[int, Tensor, _Next], _Next]
#: ``phase(name)``: called as each phase of a request begins: ``"contexts"`` (VAE encode and prefill), then
#: ``"answer"`` (understanding), or ``"think"`` (a think text), ``"denoise"`` and ``"decode"`` (the VAE decode; the
#: request's KV caches are released before it). A memory meter reads each phase's peak with it.
PhaseFn = Callable[[str], None]


@dataclass(frozen=True)
class RunHooks:
    """Callbacks of one request (each optional): progress, cancellation, live preview, steering, phases."""

    progress: ProgressFn | None = None
    cancel: CancelFn | None = None
    preview: PreviewFn | None = None
    steer: SteerFn | None = None
    phase: PhaseFn | None = None

    def enter(self, name: str) -> None:
        """The request begins phase ``name`` (see :data:`PhaseFn`)."""
        if self.phase is not None:
            self.phase(name)

    def cancelled(self) -> bool:
        return self.cancel is not None and bool(self.cancel())

    def report(self, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(done, total)

    def steered(self, step: int, output: Tensor, proposed: _Next) -> _Next:
        """What the loop continues from after ``step``: ``proposed``, or what :attr:`steer` returns instead."""
        if self.steer is None:
            return proposed
        chosen = self.steer(step, output, proposed)
        if isinstance(proposed, Tensor):
            if not isinstance(chosen, Tensor) or chosen.shape != proposed.shape or not chosen.is_floating_point():
                got = tuple(chosen.shape) if isinstance(chosen, Tensor) else type(chosen).__name__
                raise ValueError(
                    f"`steer` must return the next latent as a float tensor of shape {tuple(proposed.shape)}, got {got}"
                )
            return chosen.to(device=proposed.device, dtype=proposed.dtype)
        if isinstance(chosen, bool) or not isinstance(chosen, int) or chosen < 0:
            raise ValueError(f"`steer` must return the next token id as an int >= 0, got {chosen!r}")
        return chosen


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

__all__ = ["CancelFn", "GivenLatents", "NO_GIVEN_LATENTS", "NO_HOOKS", "PreviewFn", "ProgressFn", "RunHooks", "SteerFn"]
