"""Weight dtypes of a BAGEL build outside ComfyUI: the names users pick, the model build for each, the
per-tensor conversion a loader calls while it reads a checkpoint, and the bytes a model holds.

``weight_dtype`` is how the Linear and Embedding weights are stored; the hidden states are computed in the
compute dtype (``dtype``), to which each layer upcasts its weight at every call
(:mod:`.modeling.operations`). Norms, biases and the sin-cos tables stay in the compute dtype.

========== ===================================================================== ======================
name       storage                                                               bytes per weight
========== ===================================================================== ======================
auto       the compute dtype (plain ``torch.nn`` layers, nothing upcast)          2 (bf16, fp16) / 4
bf16/fp16  that dtype, cast to the compute dtype per call                         2
fp32       fp32, cast per call                                                    4
fp8_e4m3fn fp8 with one fp32 scale per output channel (row absmax → 448)         1 (+4 per row)
fp8_e5m2   fp8 with one fp32 scale per output channel (row absmax → 57344)       1 (+4 per row)
int8       int8 weight-only, one fp32 scale per output channel (absmax → 127)    1 (+4 per row)
========== ===================================================================== ======================

The output head (``language_model.lm_head``) is the exception: under an 8-bit ``weight_dtype`` it keeps a
16-bit storage (:func:`head_storage_dtype`), as weight-only LLM quantization usually does (LLM.int8(), GPTQ,
AWQ leave ``lm_head`` alone). It decides which token wins, often by a thin margin: on the bundled model with
the head at 8 bits, 7 (int8), 15 (fp8_e4m3fn) and 41 (fp8_e5m2) of 120 understanding answers changed
against bf16; with the head at 16 bits, none did. At the real geometry the head is 545M of 14.7B
parameters: 0.55 GB more than an all-8-bit model.

A loader builds the model on the meta device (:func:`build_bagel`), checks the checkpoint's names and shapes
against :func:`checkpoint_shapes` and hands each tensor, as it reads it, to :func:`assign_checkpoint_tensor`,
which converts it to the layer's storage and places it: the checkpoint is never held whole.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from .config import BagelConfig
from .modeling import Bagel
from .modeling.operations import (
    TorchOperations,
    check_compute_dtype,
    check_operations,
    is_low_precision,
    low_precision_operations,
    shared_upcasts,
    store_weight,
)

if TYPE_CHECKING:
    from .modeling.operations import _LowPrecisionWeight

#: ``weight_dtype`` names → storage dtype (``None``: the compute dtype).
WEIGHT_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp8_e4m3fn": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}


def parse_weight_dtype(value: Any) -> str:
    """A ``weight_dtype`` name (case-insensitive) or the matching ``torch.dtype`` → its name in
    :data:`WEIGHT_DTYPES`."""
    if isinstance(value, torch.dtype):
        for name, dtype in WEIGHT_DTYPES.items():
            if dtype == value:
                return name
    elif isinstance(value, str) and value.lower() in WEIGHT_DTYPES:
        return value.lower()
    raise ValueError(f"`weight_dtype` {value!r} is not supported; choose one of {', '.join(WEIGHT_DTYPES)}")


def weight_operations(weight_dtype: Any, compute_dtype: torch.dtype) -> type:
    """The operations namespace that stores Linear/Embedding weights as ``weight_dtype`` for ``compute_dtype``.

    ``auto`` or a weight dtype equal to the compute dtype gives :class:`TorchOperations` (nothing upcast).
    """
    storage = WEIGHT_DTYPES[parse_weight_dtype(weight_dtype)]
    check_compute_dtype(compute_dtype, "dtype")
    if storage is None or storage == compute_dtype:
        return TorchOperations
    return low_precision_operations(storage)


def head_storage_dtype(weight_dtype: Any, compute_dtype: torch.dtype) -> torch.dtype | None:
    """The storage of the output head for ``weight_dtype``: ``None`` (the same as every other layer) unless
    ``weight_dtype`` stores under 16 bits; then the compute dtype when it is 16-bit, else bf16."""
    storage = WEIGHT_DTYPES[parse_weight_dtype(weight_dtype)]
    check_compute_dtype(compute_dtype, "dtype")
    if storage is None or storage.itemsize >= 2:
        return None
    return compute_dtype if compute_dtype.itemsize == 2 else torch.bfloat16


@dataclass(frozen=True)
class HostOperations:
    """A ``weight_dtype`` for :func:`~.checkpoint.loader.load_bagel` whose layers come from a host: every
    weight-bearing layer of BAGEL and its VAE is built from ``operations`` (e.g. ComfyUI's
    ``comfy.ops.pick_operations(...)``, which stores weights and casts them per call itself), with the weights
    stored as ``weight_dtype`` by a plain cast (:func:`plain_storage_dtype`). ``unicache_core`` never imports
    the host: the namespace comes from the caller."""

    operations: Any
    weight_dtype: str = "auto"


def plain_storage_dtype(weight_dtype: Any, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype a foreign operations namespace (one that stores and casts weights itself, e.g. ComfyUI's
    ``comfy.ops``) is given as ``dtype=`` for ``weight_dtype``: that dtype as a plain cast, ``auto`` = the compute
    dtype. ``int8`` needs a per-channel scale, which only :func:`low_precision_operations` keeps: refused."""
    name = parse_weight_dtype(weight_dtype)
    check_compute_dtype(compute_dtype, "dtype")
    if name == "int8":
        plain = ", ".join(n for n in WEIGHT_DTYPES if n != "int8")
        raise ValueError(
            f"`weight_dtype` 'int8' keeps a scale per output channel, which only the library's own "
            f"layers store; with a host's operations (HostOperations) choose one of {plain}, or pass "
            f"'int8' alone for the library's layers"
        )
    storage = WEIGHT_DTYPES[name]
    return compute_dtype if storage is None else storage


def build_bagel(
    config: BagelConfig,
    *,
    weight_dtype: Any = "auto",
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = "meta",
    operations: Any = None,
) -> Bagel:
    """BAGEL with its Linear/Embedding weights stored as ``weight_dtype``, computing in ``dtype``.

    Args:
        config: the model's configuration.
        weight_dtype: a name of :data:`WEIGHT_DTYPES` (or the matching ``torch.dtype``).
        dtype: the compute dtype (bf16, fp16 or fp32): hidden states, norms, biases, tables.
        device: where to allocate; ``"meta"`` (the default) allocates nothing, for a loader that assigns
            every tensor with :func:`assign_checkpoint_tensor` and then calls ``model.reset_buffers(device)``
            (the RoPE frequencies are not in checkpoints).
        operations: ``None`` (the library's layers for ``weight_dtype``: :func:`weight_operations`), or a namespace
            that stores and casts weights itself, such as a ComfyUI host's ``comfy.ops.pick_operations(...)``:
            every layer is then built from it with ``dtype=`` :func:`plain_storage_dtype` (fp8 as a plain cast,
            as ComfyUI stores it) and ``compute_dtype=dtype``.

        Either way the output head is stored as :func:`head_storage_dtype` under an 8-bit ``weight_dtype``.

    Returns:
        the model in eval mode with no parameter requiring gradients.
    """
    head = head_storage_dtype(weight_dtype, dtype)
    if operations is None:
        model = Bagel(
            config,
            operations=weight_operations(weight_dtype, dtype),
            dtype=dtype,
            device=device,
            head_operations=None if head is None else weight_operations(head, dtype),
        )
    else:
        model = Bagel(
            config,
            operations=check_operations(operations),
            dtype=plain_storage_dtype(weight_dtype, dtype),
            compute_dtype=dtype,
            device=device,
            head_dtype=head,
        )
    model.requires_grad_(False)
    return model.eval()


def checkpoint_shapes(model: nn.Module) -> dict[str, torch.Size]:
    """Name → shape of every tensor a checkpoint must provide for ``model`` (its state dict less the scales
    that low-precision layers compute themselves)."""
    shapes = {}
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for name, tensor in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            if is_low_precision(module) and name == "weight_scale":
                continue
            if name in getattr(module, "_non_persistent_buffers_set", ()):
                continue
            shapes[prefix + name] = tensor.shape
    return shapes


def assign_checkpoint_tensor(
    model: nn.Module, name: str, tensor: Tensor, *, device: torch.device | str | None = None
) -> None:
    """Convert one checkpoint tensor to its storage in ``model`` and put it in place (replacing a meta tensor).

    A low-precision layer's ``weight`` is quantized where ``tensor`` is (its scale set alongside); every other
    tensor is cast to the dtype ``model`` declares for it (e.g. ComfyUI's fp8 storage). The result is moved
    to ``device`` (default: where the model's tensor is, or the CPU for a meta tensor) and never requires
    gradients. Only ``tensor`` and its converted copy are alive at once, so a loader that calls this per
    tensor as it reads holds the final model plus about one tensor.

    Raises:
        ValueError: ``name`` is not a tensor of ``model`` (see :func:`checkpoint_shapes`) or the shape differs.
    """
    module_name, _, leaf = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        module = None
    current = getattr(module, leaf, None) if module is not None else None
    if module is None or not isinstance(current, Tensor) or (is_low_precision(module) and leaf == "weight_scale"):
        raise ValueError(f"the model has no tensor {name!r} to load; the checkpoint does not match this model")
    if tuple(tensor.shape) != tuple(current.shape):
        raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(current.shape)}")
    target = torch.device(device) if device is not None else current.device
    if target.type == "meta":
        target = torch.device("cpu")
    if is_low_precision(module) and leaf == "weight":
        layer = cast("_LowPrecisionWeight", module)  # what is_low_precision tests for
        layer.load_weight(tensor)
        layer.weight = nn.Parameter(layer.weight.to(target), requires_grad=False)
        if layer.weight_scale is not None:
            layer.weight_scale = nn.Parameter(layer.weight_scale.to(target), requires_grad=False)
        return
    value = tensor.to(device=target, dtype=current.dtype)
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[leaf] = value


def _unique_tensors(module: nn.Module) -> list[Tensor]:
    seen: set[Hashable] = set()
    found: list[Tensor] = []
    for tensor in list(module.parameters()) + list(module.buffers()):
        key: Hashable  # a meta tensor's identity, else where its data starts
        if tensor.device.type == "meta":
            key = id(tensor)
        else:
            key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key not in seen:
            seen.add(key)
            found.append(tensor)
    return found


def parameter_bytes(module: nn.Module) -> int:
    """Bytes held by ``module``'s parameters and buffers (each tensor counted once), as stored."""
    return sum(t.numel() * t.element_size() for t in _unique_tensors(module))


def parameter_bytes_by_dtype(module: nn.Module) -> dict[str, int]:
    """:func:`parameter_bytes` split by stored dtype name (``"bfloat16"``, ``"int8"``, ...)."""
    totals: dict[str, int] = defaultdict(int)
    for t in _unique_tensors(module):
        totals[str(t.dtype).removeprefix("torch.")] += t.numel() * t.element_size()
    return dict(totals)


__all__ = [
    "HostOperations",
    "WEIGHT_DTYPES",
    "assign_checkpoint_tensor",
    "build_bagel",
    "checkpoint_shapes",
    "head_storage_dtype",
    "parameter_bytes",
    "parameter_bytes_by_dtype",
    "parse_weight_dtype",
    "plain_storage_dtype",
    "shared_upcasts",
    "store_weight",
    "weight_operations",
]
