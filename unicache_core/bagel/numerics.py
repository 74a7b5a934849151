"""Finite-value checks: NaN or infinite values never silently become an image or a text.

Each check sits where non-finite values first show up and raises one
:class:`~unicache_core.errors.NumericalError`. The message names the tensor, or the step and branch,
and says what to change.

=====================  ==========================================  ==========================================
where                  checked                                     typical cause / advice
=====================  ==========================================  ==========================================
loading                every floating tensor, before and after     corrupt file (re-download it); overflow
                       the cast to the model dtype                 when cast to fp16 (use bf16 or fp32)
injected noise         ``initial_noise``, ``vae_noise``            the caller's tensor
text decoding          the next-token logits of every step         fp16 overflow, broken weights
denoising              each raw branch velocity, then the guided   fp16 overflow; a too-large CFG scale
                       velocity, at every step
VAE                    the encoded source latent (edit), the       broken VAE weights
                       final latent and the decoded pixels
=====================  ==========================================  ==========================================

The checks are cheap. A tensor is first summed, and the sum is non-finite whenever an element is.
Only when the sum is non-finite does an exact element-wise test run, because a sum of finite values
can overflow. Loading a 7B checkpoint therefore adds about one pass over the weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor

from ..errors import NumericalError

#: Elements per chunk of the exact (slow-path) test, to bound its temporary memory.
_CHUNK = 1 << 24


def all_finite(tensor: Tensor) -> bool:
    """True when no element of ``tensor`` is NaN or infinite (integer and empty tensors are finite)."""
    if not (tensor.is_floating_point() or tensor.is_complex()) or tensor.numel() == 0:
        return True
    flat = tensor.reshape(-1)
    if tensor.element_size() == 1:  # fp8: no sum kernel on the CPU; test fp32 copies chunk by chunk
        return all(bool(torch.isfinite(chunk.float()).all()) for chunk in flat.split(_CHUNK))
    if bool(torch.isfinite(tensor.sum())):
        return True
    return all(bool(torch.isfinite(chunk).all()) for chunk in flat.split(_CHUNK))


def describe_non_finite(tensor: Tensor) -> str:
    """``'3 NaN and 1 infinite of 4096 values'``; call it only on the error path (it is a full pass)."""
    nan = int(torch.isnan(tensor).sum())
    inf = int(torch.isinf(tensor).sum())
    parts = [f"{nan} NaN"] if nan else []
    if inf:
        parts.append(f"{inf} infinite")
    return f"{' and '.join(parts) or 'non-finite'} of {tensor.numel()} values"


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype, str(dtype))


def model_advice(dtype: torch.dtype) -> str:
    """What to try when the model's own computation produced NaN/inf (depends on the model dtype)."""
    if dtype == torch.float16:
        return (
            "the model runs in fp16, whose range (±65504) overflows easily: run it in bf16 (or fp32) instead "
            "(dtype 'bf16': --dtype bf16 on the command line, the loader's dtype in ComfyUI)"
        )
    return (
        f"the model runs in {_dtype_name(dtype)}; check the checkpoint (re-download ema.safetensors, make sure "
        f"the config files belong to it) or try dtype='fp32'"
    )


def check_weight(path: Path, name: str, stored: Tensor, loaded: Tensor) -> None:
    """Refuse a weight that is non-finite in the file (corrupt) or becomes non-finite when cast (overflow)."""
    if all_finite(loaded):
        return
    if not all_finite(stored):
        raise NumericalError(
            f"{path}: tensor {name!r} holds {describe_non_finite(stored)} in the file; the weights are corrupt: "
            f"re-download {path.name}"
        )
    biggest = float(stored.abs().max())
    raise NumericalError(
        f"{path}: tensor {name!r} has values up to {biggest:g}, which overflow {_dtype_name(loaded.dtype)} "
        f"(largest finite value {torch.finfo(loaded.dtype).max:g}); keep {_dtype_name(loaded.dtype)} out of the "
        f"weights: dtype 'bf16' or 'fp32' with weight_dtype 'auto', 'bf16' or an 8-bit storage (command line: "
        f"--dtype bf16 --weight-dtype auto)"
    )


def check_noise(name: str, noise: object, shape: Sequence[int]) -> Tensor:
    """Validate caller-supplied noise (``initial_noise``, ``vae_noise``); returns it unchanged.

    Raises:
        ValueError: not a real floating-point tensor of ``shape``.
        NumericalError: it holds NaN or infinite values.
    """
    shape = tuple(shape)
    if not isinstance(noise, Tensor):
        raise ValueError(f"`{name}` must be a torch.Tensor of shape {shape}, got {type(noise).__name__}")
    if tuple(noise.shape) != shape:
        raise ValueError(f"`{name}` must be a tensor of shape {shape}, got {tuple(noise.shape)}")
    if not noise.is_floating_point():
        raise ValueError(f"`{name}` must be a floating-point tensor (e.g. float32), got dtype {noise.dtype}")
    if not all_finite(noise):
        raise NumericalError(
            f"`{name}` holds {describe_non_finite(noise)}; pass finite noise (e.g. torch.randn(...)) or leave it "
            f"None to draw it from the seed"
        )
    return noise


def check_logits(logits: Tensor, *, step: int, max_new_tokens: int, dtype: torch.dtype) -> None:
    """Next-token logits of decoding step ``step`` (0-based) must be finite (greedy argmax of NaN is garbage)."""
    if all_finite(logits):
        return
    raise NumericalError(
        f"text decoding step {step + 1} of at most {max_new_tokens}: the next-token logits hold "
        f"{describe_non_finite(logits)}; {model_advice(dtype)}"
    )


def check_velocities(
    raw: Mapping[str, Tensor],
    guided: Tensor,
    *,
    step: int,
    total: int,
    dtype: torch.dtype,
    cfg_text_scale: float,
    cfg_img_scale: float,
) -> None:
    """Every raw branch velocity, then the guided one, of denoising step ``step`` (0-based) must be finite.

    One device synchronisation per step in the normal (finite) case.
    """
    names = [*raw, "guided"]
    tensors = [*raw.values(), guided]
    sums = torch.stack([t.sum().float().to(guided.device) for t in tensors])
    if bool(torch.isfinite(sums).all()):
        return
    where = f"denoising step {step + 1} of {total}"
    for name, tensor in zip(names, tensors):
        if all_finite(tensor):
            continue
        if name != "guided":
            raise NumericalError(
                f"{where}: the velocity of the {name!r} branch holds {describe_non_finite(tensor)}; "
                f"{model_advice(dtype)}"
            )
        fp16 = " or load the model with dtype='bf16'/'fp32' instead of 'fp16'" if dtype == torch.float16 else ""
        raise NumericalError(
            f"{where}: the branch velocities are finite but the CFG-guided velocity holds "
            f"{describe_non_finite(tensor)} (cfg_text_scale={cfg_text_scale:g}, cfg_img_scale={cfg_img_scale:g}); "
            f"lower the guidance scales{fp16}"
        )


def check_finite(tensor: Tensor, what: str, advice: str) -> None:
    """Generic check: ``what`` names the tensor in the message, ``advice`` says what to do."""
    if not all_finite(tensor):
        raise NumericalError(f"{what} holds {describe_non_finite(tensor)}; {advice}")


__all__ = [
    "all_finite",
    "check_finite",
    "check_logits",
    "check_noise",
    "check_velocities",
    "check_weight",
    "describe_non_finite",
    "model_advice",
]
