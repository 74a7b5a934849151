"""Checks of node inputs that ComfyUI's own validation lets through.

* :func:`check_widgets` is the body of the nodes' ``validate_inputs`` (:class:`~.base.UniCacheNode`): ComfyUI
  compares a FLOAT with its ``min``/``max`` by ``<``/``>``, so ``nan`` passes, and it never checks an INT's
  ``step``. A node with ``validate_inputs`` also loses ComfyUI's range check, and 0.3.75 checks no V3 combo, so
  ranges and choices are checked here too.
  A failure is refused at ``/prompt`` (HTTP 400) with one line naming the input and the value.
* :func:`check_source_latent` refuses a ``LATENT`` that is not an encoded image of this model's VAE format
  (another model's channel count, a video latent, an empty latent, non-finite values) before anything runs.
* :func:`fit_source_latent` puts a ``VAEEncode`` latent of any size on BAGEL's grid (or refuses one larger than
  BAGEL's latent position table).
"""

from __future__ import annotations

import math

#: Widgets whose value must be a multiple of their ``step`` (the output size: latent tokens are ``step`` px).
MULTIPLE_OF_STEP = ("width", "height")


def _specs(node_class) -> dict:
    inputs = node_class.INPUT_TYPES()
    return {**inputs.get("required", {}), **inputs.get("optional", {})}


def _choice_error(name: str, value, options: list) -> str:
    shown = ", ".join(map(str, options)) if len(options) <= 12 else f"one of the {len(options)} choices"
    return f"{name} = {value!r} is not a choice of this input ({shown}); pick one of its choices"


def check_widgets(node_class, **values) -> bool | str:
    """``True``, or one line naming the first widget value outside its declaration: not finite, below ``min``,
    above ``max``, (for :data:`MULTIPLE_OF_STEP`) not a multiple of ``step``, or not one of a COMBO's options (a V3
    combo is not checked by ComfyUI 0.3.75). Values of names the node does not declare and ``None`` (a linked
    input, whose value is not known at validation) are left to the node's run-time checks."""
    specs = _specs(node_class)
    for name, value in values.items():
        spec = specs.get(name)
        if value is None or spec is None:
            continue
        kind, opts = spec[0], spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
        if kind == "COMBO" or isinstance(kind, list):
            options = list(opts.get("options", kind if isinstance(kind, list) else []))
            if value not in options:
                return _choice_error(name, value, options)
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        lo, hi = opts.get("min"), opts.get("max")
        if isinstance(value, float) and not math.isfinite(value):
            return f"{name} = {value!r} is not a finite number; give a value in [{lo}, {hi}]"
        if lo is not None and value < lo or hi is not None and value > hi:
            return f"{name} = {value!r} is outside [{lo}, {hi}]; give a value in that range"
        step = opts.get("step")
        if name in MULTIPLE_OF_STEP and step and value % step:
            low = max(step, value - value % step)
            return (
                f"{name} = {value!r} is not a multiple of {step} (BAGEL's latent tokens are {step} px wide); use "
                f"{low} or {low + step}"
            )
    return True


def check_source_latent(latent, channels: int, name: str = "latent"):
    """The ``samples`` ``[batch, channels, h, w]`` of a ComfyUI ``LATENT`` that holds encoded images of this
    model's VAE (``channels``: the checkpoint's ``z_channels``, 16 for BAGEL's FLUX VAE); else a ValueError.

    Refused: not a LATENT dict, a video latent (5 dims), another model's channel count (4 for SD1/SDXL, 32 or
    128 for FLUX.2), non-finite values and a constant latent (an empty latent such as EmptySD3LatentImage's
    zeros is not an encoded image). The spatial size is :func:`fit_source_latent`'s.
    """
    import torch

    samples = latent.get("samples") if isinstance(latent, dict) else None
    if not isinstance(samples, torch.Tensor):
        got = type(latent).__name__ if samples is None else f"samples of type {type(samples).__name__}"
        raise ValueError(
            f"`{name}` must be a LATENT {{'samples': [batch, {channels}, H/8, W/8]}} from VAEEncode, got {got}"
        )
    if samples.ndim != 4 or samples.shape[1] != channels:
        raise ValueError(
            f"`{name}` has shape {tuple(samples.shape)}, not a LATENT [batch, {channels}, H/8, W/8] of BAGEL's FLUX "
            f"VAE (another model's latent?); encode the source with VAEEncode and the FLUX VAE (ae.safetensors)"
        )
    if samples.numel() == 0:
        raise ValueError(f"`{name}` is empty (shape {tuple(samples.shape)}); encode the source image with VAEEncode")
    finite = torch.isfinite(samples)
    if not bool(finite.all()):
        raise ValueError(
            f"`{name}` holds {int((~finite).sum())} NaN or infinite values; encode the source image "
            f"again with VAEEncode"
        )
    first = samples.reshape(-1)[0]
    if bool((samples == first).all()):
        raise ValueError(
            f"`{name}` holds only the value {float(first):g}: an empty latent (e.g. EmptySD3LatentImage), not an "
            f"encoded image; connect VAEEncode of the source image with the FLUX VAE"
        )
    return samples


#: What to do with a latent larger than BAGEL's position table (ComfyUI's own nodes).
TOO_LARGE_LATENT_FIX = (
    "scale the image down before VAEEncode (e.g. core ImageScaleToTotalPixels at 1.0 megapixels, "
    "or ImageScale to at most 1024 px per side), or disconnect `latent` so that BAGEL resizes "
    "the image itself"
)


def fit_source_latent(samples, config, name: str = "latent"):
    """A ``VAEEncode`` latent ``[batch, C, rows, cols]`` of any size on BAGEL's grid: an odd last row or column
    is dropped (BAGEL packs 2x2 latent cells, 16 px, into one token, and ComfyUI's VAEEncode makes 8-px cells),
    so a 400x300 image (VAEEncode: 400x296, 50x37 cells) edits at 400x288. A latent with more cells per side than
    BAGEL's latent position table (1024 px) is refused with one line saying how to scale it
    (:func:`~unicache_core.bagel.settings.source_latent_size`).

    Returns:
        ``(samples[..., :rows', :cols'], (width, height))``: the cropped latent and the edit's output size in px.
    """
    from unicache_core.bagel.settings import source_latent_size

    patch = config.latent_patch_size
    rows, cols = samples.shape[-2] - samples.shape[-2] % patch, samples.shape[-1] - samples.shape[-1] % patch
    if rows == 0 or cols == 0:
        cell = config.ae.downsample
        raise ValueError(
            f"`{name}` is {samples.shape[-2]}x{samples.shape[-1]} latent cells, smaller than one BAGEL "
            f"token ({patch}x{patch} cells, {patch * cell} px); encode an image at least "
            f"{patch * cell} px on each side"
        )
    size = source_latent_size(config, rows, cols, name=name, fix=TOO_LARGE_LATENT_FIX)
    return samples[..., :rows, :cols], size


#: The error ComfyUI files for each input of a node whose ``validate_inputs`` refused (0.3.75, execution.py).
CUSTOM_VALIDATION = "custom_validation_failed"


def _named_input(message: str, names: list[str]) -> str | None:
    """The input a refusal is about: the one its message starts with (``width = 40 ...``, ```rho` (0.5) ...``)."""
    head = message.lstrip("`")
    for name in sorted(names, key=len, reverse=True):  # rho_floor before rho
        rest = head[len(name) : len(name) + 1]
        if head.startswith(name) and not (rest.isalnum() or rest == "_"):
            return name
    return None


def one_error_per_input(body: dict, classes: set[str]) -> dict:
    """A ``/prompt`` HTTP 400 body with each refusal of the pack's nodes (``classes``: their node ids) given once,
    tagged with the input it is about.

    ComfyUI 0.3.75 files the one message ``validate_inputs`` returns once per input of the node (13 errors on a task
    node, each tagged with another input: ``steps - width = 40 is not a multiple of 16``); the node's inputs are all
    passed to it, so it cannot say which one a message is about. Of each run of identical messages the error of the
    input the message names is kept (else the first), and the summary's ``error.details`` lines of the others go.
    Anything else in the body is left as it is."""
    node_errors = body.get("node_errors") if isinstance(body, dict) else None
    if not isinstance(node_errors, dict):
        return body
    dropped: list[str] = []
    for entry in node_errors.values():
        if not isinstance(entry, dict) or entry.get("class_type") not in classes:
            continue
        errors = entry.get("errors")
        if not isinstance(errors, list):
            continue
        groups: dict[str, list[dict]] = {}
        for error in errors:
            if (
                isinstance(error, dict)
                and error.get("type") == CUSTOM_VALIDATION
                and " - " in str(error.get("details"))
            ):
                groups.setdefault(str(error["details"]).split(" - ", 1)[1], []).append(error)
        keep = []
        for message, group in groups.items():
            name = _named_input(message, [str(e.get("extra_info", {}).get("input_name")) for e in group])
            keep.append(next((e for e in group if e.get("extra_info", {}).get("input_name") == name), group[0]))
        kept_ids = {id(e) for e in keep}
        grouped = {id(e) for group in groups.values() for e in group}
        dropped += [f"{e.get('message')}: {e.get('details')}" for e in errors if id(e) in grouped - kept_ids]
        entry["errors"] = [e for e in errors if id(e) not in grouped or id(e) in kept_ids]
    error = body.get("error")
    if dropped and isinstance(error, dict) and isinstance(error.get("details"), str):
        lines = error["details"].split("\n")
        for line in dropped:
            if line in lines:
                lines.remove(line)
        error["details"] = "\n".join(lines)
    return body


__all__ = [
    "CUSTOM_VALIDATION",
    "MULTIPLE_OF_STEP",
    "TOO_LARGE_LATENT_FIX",
    "check_source_latent",
    "check_widgets",
    "fit_source_latent",
    "one_error_per_input",
]
