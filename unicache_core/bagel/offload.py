"""Layer offload outside ComfyUI: decoder layers live in host memory and visit the compute device to run.

:func:`apply_layer_offload` puts everything of a :class:`~.modeling.Bagel` except its decoder layers on the
compute device and keeps each decoder layer's tensors in host memory (pinned when CUDA is available, so
copies are asynchronous). A forward pre-hook (accelerate's ``ModelHook``) on each layer brings that layer to
the device just before it runs and starts copying the next layer (the one after the last is the first,
for the next pass) on a side CUDA stream, so the copy overlaps the current layer's compute. A layer stays
on the device until another layer is brought in, so the CFG branches of one step run through a layer
together (:meth:`~.modeling.Bagel.forward_llm_branches`) copy it once; at most the running layer, the
previous one until the switch, and the prefetched one are on the device.

accelerate's own ``AlignDevicesHook`` (what ``load_bagel(device_map=...)`` uses to offload) copies a module
in at every call and drops it after, without prefetching or pinning; the hook here adds those two and the
keep-until-switch rule. Inside ComfyUI, offloading is ComfyUI's job (partial loading of the modules built
from its operations).

The copies are made even when the compute device is the CPU (a fresh device copy per visit), so the
mechanism is the same, and testable, without a GPU. Outputs are identical to the resident model: the
same tensors, copied exactly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from .modeling import Bagel

logger = logging.getLogger(__name__)


def _import_accelerate_hooks():
    try:
        from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module
    except ImportError as exc:
        raise ImportError(
            "layer offload needs the `accelerate` package; install it with `pip install accelerate==1.16.0` "
            "(or `pip install comfyui-unicache-bagel[offload]`), or run without offload"
        ) from exc
    return ModelHook, add_hook_to_module, remove_hook_from_module


def _layer_tensors(layer: nn.Module) -> list[tuple[nn.Module, str, bool]]:
    """``(owner module, attribute name, is_parameter)`` of every parameter and buffer of ``layer``."""
    found = []
    for module in layer.modules():
        found += [(module, name, True) for name, p in module._parameters.items() if p is not None]
        found += [(module, name, False) for name, b in module._buffers.items() if b is not None]
    return found


def _set_tensor(module: nn.Module, name: str, is_param: bool, value: Tensor) -> None:
    if is_param:
        module._parameters[name] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[name] = value


@dataclass
class _HostLayer:
    """One decoder layer: its tensors' host copies and, while visiting, their device copies."""

    layer: nn.Module = field(repr=False)
    slots: list[tuple[nn.Module, str, bool]] = field(repr=False)
    host: list[Tensor] = field(repr=False)
    device_copies: list[Tensor] | None = field(default=None, repr=False)
    ready: Any = field(default=None, repr=False)  # CUDA event recorded after the prefetch copies


@dataclass
class LayerOffload:
    """The state shared by the offload hooks of one model (returned by :func:`apply_layer_offload`).

    Attributes:
        device: the compute device.
        prefetch: whether the next layer is copied while the current one runs.
        transfers: layers copied to the device so far (a test and report counter).
    """

    device: torch.device
    prefetch: bool
    layers: list[_HostLayer] = field(repr=False)
    stream: Any = None
    current: int | None = None
    transfers: int = 0
    _hooks_removed: bool = field(default=False, repr=False)

    def _copy_in(self, index: int) -> list[Tensor]:
        """Layer ``index``'s device copies, started now unless already there (or on their way)."""
        entry = self.layers[index]
        if entry.device_copies is not None:
            return entry.device_copies
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                copies = [t.to(self.device, non_blocking=True, copy=True) for t in entry.host]
                entry.ready = torch.cuda.Event()
                entry.ready.record(self.stream)
        else:
            copies = [t.to(self.device, copy=True) for t in entry.host]
        entry.device_copies = copies
        self.transfers += 1
        return copies

    def _attach(self, index: int) -> None:
        entry = self.layers[index]
        copies = self._copy_in(index)
        if entry.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(entry.ready)
            for t in copies:
                t.record_stream(torch.cuda.current_stream(self.device))
            entry.ready = None
        for (module, name, is_param), value in zip(entry.slots, copies):
            _set_tensor(module, name, is_param, value)

    def _detach(self, index: int) -> None:
        entry = self.layers[index]
        for (module, name, is_param), value in zip(entry.slots, entry.host):
            _set_tensor(module, name, is_param, value)
        entry.device_copies = None
        entry.ready = None

    def enter(self, index: int) -> None:
        """Make layer ``index`` the one on the device (called by its pre-forward hook)."""
        if self.current == index:
            return
        if self.current is not None:
            self._detach(self.current)
        self._attach(index)
        self.current = index
        if self.prefetch and len(self.layers) > 1:
            self._copy_in((index + 1) % len(self.layers))

    def release(self) -> None:
        """Send every layer back to host memory (frees the device copies; the hooks stay)."""
        for index, entry in enumerate(self.layers):
            if entry.device_copies is not None or index == self.current:
                self._detach(index)
        self.current = None

    def remove(self) -> None:
        """Release and remove the hooks; the layers stay in host memory."""
        self.release()
        if not self._hooks_removed:
            _, _, remove_hook_from_module = _import_accelerate_hooks()
            for entry in self.layers:
                remove_hook_from_module(entry.layer)
            self._hooks_removed = True

    def device_layers(self) -> int:
        """How many layers have a copy on the device now (the running one included)."""
        return sum(entry.device_copies is not None for entry in self.layers)


def _add_visit_hooks(offload: LayerOffload, decoder_layers: list[nn.Module]) -> None:
    """An accelerate hook on each of ``decoder_layers`` that brings the layer to the device before its forward."""
    from accelerate.hooks import ModelHook, add_hook_to_module  # a class to derive from: imported by name

    class LayerVisitHook(ModelHook):
        """Brings its decoder layer to the device before the layer's forward."""

        def __init__(self, index: int):
            self.index = index

        def pre_forward(self, module, *args, **kwargs):
            offload.enter(self.index)
            return args, kwargs

    for index, layer in enumerate(decoder_layers):
        add_hook_to_module(layer, LayerVisitHook(index))


def apply_layer_offload(
    model: Bagel, device: torch.device | str, *, prefetch: bool = True, pin_memory: bool | None = None
) -> LayerOffload:
    """Keep ``model``'s decoder layers in host memory and bring each to ``device`` just before it runs.

    Args:
        model: a :class:`~.modeling.Bagel` with its weights loaded (not on the meta device).
        device: the compute device; every other module (embeddings, ``lm_head``, ViT, heads) is moved there
            and ``model.execution_device`` is set to it.
        prefetch: copy the next layer while the current one runs (on a side stream on CUDA).
        pin_memory: pin the host copies (default: when CUDA is available), for asynchronous copies.

    Returns:
        the :class:`LayerOffload` handle (``release()`` frees the device copies, ``remove()`` the hooks).

    Raises:
        ImportError: accelerate is not installed; ValueError: a meta tensor, or a model already offloaded.
    """
    _import_accelerate_hooks()  # one clear ImportError without accelerate, before any work
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
    decoder_layers = list(model.language_model.model.layers)
    if any(getattr(layer, "_hf_hook", None) is not None for layer in decoder_layers):
        raise ValueError(
            "the model's decoder layers already carry accelerate hooks (an offload or a device_map "
            "dispatch); load the model again without them before apply_layer_offload"
        )
    meta = [name for name, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if meta:
        raise ValueError(
            f"apply_layer_offload needs a loaded model; {len(meta)} tensors are on the meta device (e.g. {meta[0]!r})"
        )
    in_layers = {id(m) for layer in decoder_layers for m in layer.modules()}
    for module in model.modules():  # every module outside the decoder layers goes to the device
        if id(module) in in_layers:
            continue
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = nn.Parameter(p.to(device), requires_grad=p.requires_grad)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = b.to(device)
    entries = []
    for layer in decoder_layers:
        slots = _layer_tensors(layer)
        host = []
        for module, name, _ in slots:
            tensor = getattr(module, name).detach().to("cpu")
            host.append(tensor.pin_memory() if pin_memory else tensor)
        entries.append(_HostLayer(layer, slots, host))
        for (module, name, is_param), value in zip(slots, host):
            _set_tensor(module, name, is_param, value)
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    offload = LayerOffload(device, prefetch, entries, stream)
    _add_visit_hooks(offload, decoder_layers)
    model.execution_device = device
    logger.info(
        "layer offload: %d decoder layers in %s host memory, computing on %s (prefetch %s)",
        len(entries),
        "pinned" if pin_memory else "pageable",
        device,
        prefetch,
    )
    return offload


__all__ = ["LayerOffload", "apply_layer_offload"]
