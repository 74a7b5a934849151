"""The layer families BAGEL's modules are built from (an ``operations`` namespace), and low-precision ones.

Every weight-bearing layer of BAGEL is built as ``operations.Linear``, ``operations.Conv2d``,
``operations.GroupNorm``, ``operations.LayerNorm`` or ``operations.Embedding`` with the ``torch.nn``
constructor arguments plus ``dtype=`` and ``device=``, and BAGEL's code only ever *calls* these layers (it
never reads their ``.weight``). A namespace may therefore store a weight however it likes and fetch or cast
it inside ``forward``:

- :class:`TorchOperations` (the default): ``torch.nn``'s layers, initialised as ``torch.nn`` does;
- :func:`low_precision_operations`: ``Linear`` and ``Embedding`` that store their weights in a smaller dtype
  (fp16, bf16, fp8 or int8, the last three with one scale per output channel) and upcast them to the input's
  dtype at every call;
- a ComfyUI host's ``comfy.ops`` families (``disable_weight_init``, ``manual_cast``, the result of
  ``pick_operations(...)``) fit as they are: same class names, same constructor arguments, weights cast per
  call in ``forward``. ``Embedding`` is called with ``out_dtype=`` as ComfyUI's own text encoders call it.

BAGEL's RMSNorm is not taken from the namespace: its rounding (fp32 statistics, the normalised value
rounded to the input dtype, then times the weight) differs from ``torch.nn.functional.rms_norm``'s single
rounding by one bf16 step, so it stays BAGEL's own module (:class:`~.qwen2_mot.Qwen2RMSNorm`), whose weight
is kept in the compute dtype and brought to the input's device at each call.

Upcasting a low-precision weight costs a pass over it at every call. :func:`shared_upcasts` opens a scope in
which each layer upcasts once and reuses the result (e.g. for the CFG branches of one denoising step run
through a decoder layer together, :meth:`~.qwen2_mot.Qwen2Model.forward_branches`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

#: Layer classes an operations namespace must provide.
REQUIRED_LAYERS = ("Linear", "Conv2d", "GroupNorm", "LayerNorm", "Embedding")
#: Storage dtypes kept with one scale per output channel (the weight divided by it fills the dtype's range).
SCALED_STORAGE = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)
#: Storage dtypes a low-precision layer accepts.
STORAGE_DTYPES = (torch.bfloat16, torch.float16, torch.float32) + SCALED_STORAGE
#: Dtypes hidden states are computed in.
COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: An int8 Linear called on the CPU with at most this many rows uses torch's int8 weight-only kernel
#: (``torch._weight_int8pack_mm``), which reads the int8 weight directly instead of upcasting it; above this many
#: rows the upcast and matmul is faster (docs/engine.md, "Measurements behind the engine's choices").
INT8_KERNEL_MAX_ROWS = 16
#: The kernel needs ``in_features`` a multiple of this: other widths give wrong values or crash (torch 2.14).
INT8_KERNEL_WIDTH_MULTIPLE = 16


class TorchOperations:
    """The default namespace: ``torch.nn``'s layers (``Embedding`` also takes ``out_dtype``)."""

    Linear = nn.Linear
    Conv2d = nn.Conv2d
    GroupNorm = nn.GroupNorm
    LayerNorm = nn.LayerNorm

    class Embedding(nn.Embedding):
        """``torch.nn.Embedding`` whose ``forward`` takes ComfyUI's ``out_dtype`` keyword."""

        def forward(self, input: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
            """``input [...]`` int ids → ``[..., dim]`` rows, in ``out_dtype`` when given."""
            rows = super().forward(input)
            return rows if out_dtype is None else rows.to(out_dtype)


def check_operations(operations: Any) -> Any:
    """Return ``operations`` (``None`` → :class:`TorchOperations`) after checking it has every layer class."""
    if operations is None:
        return TorchOperations
    missing = [name for name in REQUIRED_LAYERS if not isinstance(getattr(operations, name, None), type)]
    if missing:
        raise ValueError(
            f"`operations` {operations!r} lacks the layer class(es) {', '.join(missing)}; pass a namespace with "
            f"{', '.join(REQUIRED_LAYERS)} (e.g. TorchOperations, low_precision_operations(...), or ComfyUI's "
            f"comfy.ops.manual_cast)"
        )
    return operations


def check_compute_dtype(dtype: torch.dtype, what: str = "compute_dtype") -> torch.dtype:
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(
            f"`{what}` {dtype} cannot hold hidden states; use torch.bfloat16, torch.float16 or torch.float32 "
            f"(a low-precision storage dtype is given to the operations as `dtype`, with `compute_dtype` beside it)"
        )
    return dtype


@dataclass(frozen=True)
class LayerBuilder:
    """Builds BAGEL's layers from one namespace with one storage dtype and device.

    Attributes:
        operations: the namespace (:data:`REQUIRED_LAYERS`).
        dtype: passed as ``dtype=`` to every namespace layer (``None`` = torch's default dtype); with
            ComfyUI's operations it is the weight storage dtype, with :func:`low_precision_operations` the
            dtype of the biases and norms (the weight storage is the namespace's).
        device: passed as ``device=`` to every layer and used for BAGEL's own tensors.
        compute_dtype: dtype of BAGEL's own tensors (RMSNorm weights, sin-cos tables); ``None`` = ``dtype``.
        head: the builder of the output head (:meth:`output_head`); ``None`` = this one. An 8-bit build keeps
            the head at 16 bits (:func:`~..weights.head_storage_dtype`).
    """

    operations: Any = TorchOperations
    dtype: torch.dtype | None = None
    device: torch.device | str | None = None
    compute_dtype: torch.dtype | None = None
    head: LayerBuilder | None = None

    @classmethod
    def create(
        cls,
        operations: Any = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        compute_dtype: torch.dtype | None = None,
    ) -> LayerBuilder:
        """Check the arguments: the namespace's layer classes, and a compute dtype that can hold hidden states."""
        own = compute_dtype if compute_dtype is not None else dtype
        if own is not None:
            check_compute_dtype(own, "compute_dtype" if compute_dtype is not None else "dtype")
        return cls(check_operations(operations), dtype, device, compute_dtype)

    def with_head(self, operations: Any = None, dtype: torch.dtype | None = None) -> LayerBuilder:
        """This builder with an output head built from ``operations`` (``None``: this namespace) and ``dtype``
        (``None``: this dtype); unchanged when both are ``None``."""
        if operations is None and dtype is None:
            return self
        head = LayerBuilder.create(operations or self.operations, dtype or self.dtype, self.device, self.compute_dtype)
        return replace(self, head=head)

    @property
    def own_dtype(self) -> torch.dtype:
        """Dtype of BAGEL's own parameters."""
        own = self.compute_dtype if self.compute_dtype is not None else self.dtype
        return own if own is not None else torch.get_default_dtype()

    def linear(self, in_features: int, out_features: int, bias: bool = True) -> nn.Module:
        return self.operations.Linear(in_features, out_features, bias=bias, device=self.device, dtype=self.dtype)

    def output_head(self, in_features: int, out_features: int) -> nn.Module:
        """The language model's ``lm_head`` (no bias), from :attr:`head` when set."""
        return (self.head or self).linear(in_features, out_features, bias=False)

    def conv2d(
        self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, padding: int = 0
    ) -> nn.Module:
        return self.operations.Conv2d(
            in_channels, out_channels, kernel_size, stride=stride, padding=padding, device=self.device, dtype=self.dtype
        )

    def group_norm(self, num_groups: int, num_channels: int, eps: float) -> nn.Module:
        return self.operations.GroupNorm(
            num_groups, num_channels, eps=eps, affine=True, device=self.device, dtype=self.dtype
        )

    def layer_norm(self, size: int, eps: float) -> nn.Module:
        return self.operations.LayerNorm(size, eps=eps, device=self.device, dtype=self.dtype)

    def embedding(self, num_embeddings: int, embedding_dim: int) -> nn.Module:
        return self.operations.Embedding(num_embeddings, embedding_dim, device=self.device, dtype=self.dtype)

    def own_parameter(self, shape: tuple[int, ...], fill: float, *, trainable: bool = True) -> nn.Parameter:
        """A BAGEL-owned parameter ``shape`` filled with ``fill`` in :attr:`own_dtype` on the device."""
        data = torch.full(shape, fill, dtype=self.own_dtype, device=self.device)
        return nn.Parameter(data, requires_grad=trainable)


# --------------------------------------------------------------------------------------- storage


def store_weight(weight: Tensor, storage: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """Convert a ``[out, ...]`` floating weight to ``storage``.

    Float storage (bf16, fp16, fp32) is a plain cast. fp8 and int8 keep one fp32 scale per output channel
    (row): ``scale = max|row| / largest value of the dtype`` (``1`` for an all-zero row), and the row is stored
    as ``row / scale`` (int8: rounded to nearest, in ``[-127, 127]``; fp8: the dtype's own rounding, so
    small values keep their relative precision instead of falling into fp8's subnormals).

    Returns:
        ``(data, scale)``: ``data`` of ``weight``'s shape in ``storage``; ``scale [out]`` fp32, or ``None``
        for float storage.
    """
    if storage not in STORAGE_DTYPES:
        raise ValueError(f"storage dtype {storage} is not supported; allowed: {STORAGE_DTYPES}")
    if not weight.is_floating_point():
        raise ValueError(f"cannot store a {weight.dtype} tensor as {storage}: the weight must be floating point")
    if storage not in SCALED_STORAGE:
        return weight.to(storage), None
    rows = weight.reshape(weight.shape[0], -1)
    largest = 127.0 if storage == torch.int8 else torch.finfo(storage).max
    data = torch.empty(rows.shape, dtype=storage, device=weight.device)
    scale = torch.empty(rows.shape[0], dtype=torch.float32, device=weight.device)
    # in row chunks of about 16M values, so the fp32 working copy stays small beside a 545M-value table
    step = max(1, (1 << 24) // max(1, rows.shape[1]))
    for start in range(0, rows.shape[0], step):
        chunk = rows[start : start + step].to(torch.float32, copy=True)  # never divide the caller's tensor
        absmax = chunk.abs().amax(dim=1)
        chunk_scale = torch.where(absmax > 0, absmax / largest, torch.ones_like(absmax))
        chunk.div_(chunk_scale[:, None])
        if storage == torch.int8:
            chunk.round_().clamp_(-127, 127)
        else:
            chunk.clamp_(-largest, largest)
        data[start : start + step] = chunk.to(storage)
        scale[start : start + step] = chunk_scale
    return data.reshape(weight.shape), scale


def _e4m3fn_as_half(data: Tensor) -> Tensor:
    """fp8 e4m3fn → fp16 holding ``value * 2**-8`` exactly (e4m3fn's bits moved into fp16's; NaN never occurs).

    Shifting the 7 exponent/mantissa bits up by 7 lands them in fp16's fields with the exponent bias 7 instead
    of 15, normals and subnormals alike, so the result is the value times ``2**-8``; faster on the CPU than
    ``data.to(torch.bfloat16)`` (docs/engine.md, "Measurements behind the engine's choices").
    """
    bits = data.view(torch.int8).to(torch.int16)  # sign-extended: a negative value also sets bit 14, cleared below
    bits.bitwise_left_shift_(7).bitwise_and_(~0x4000)
    return bits.view(torch.float16)


def upcast_weight(
    data: Tensor, scale: Tensor | None, dtype: torch.dtype, device: torch.device, *, scale_output: bool
) -> tuple[Tensor, Tensor | None]:
    """Bring a stored weight to ``dtype`` on ``device`` (the inverse of :func:`store_weight`).

    Args:
        data: ``[out, ...]`` stored weight; scale: ``[out]`` fp32 or ``None``.
        scale_output: return the per-channel scale separately (to multiply the layer's output with, one
            pass over ``[tokens, out]`` instead of over the weight); ignored in fp16, where the unscaled
            product can exceed fp16's range, and for unscaled storage.

    Returns:
        ``(weight, output_scale)``: ``weight`` in ``dtype``; ``output_scale [out]`` in ``dtype`` or ``None`` when
        the scale is already applied to ``weight``.
    """
    data = data.to(device, non_blocking=device.type == "cuda")  # a copy to the host must be complete on return
    if data.dtype == torch.float8_e4m3fn:
        weight = _e4m3fn_as_half(data).to(dtype)
        factor = 256.0
    else:
        weight = data.to(dtype)
        factor = 1.0
    if scale is None:
        return weight, None
    channel = scale.to(device, torch.float32) * factor
    shape = (-1,) + (1,) * (weight.dim() - 1)
    if dtype == torch.float16:
        # a scale of a small row (absmax/127 of a 1e-3 row) is subnormal in fp16: multiply in fp32
        return weight.float().mul_(channel.reshape(shape)).to(dtype), None
    if scale_output:
        return weight, channel.to(dtype)
    return weight.mul_(channel.to(dtype).reshape(shape)), None


@dataclass
class UpcastCache:
    """Upcast weights kept while a :func:`shared_upcasts` scope is open, with counts for tests and reports."""

    weights: dict = field(default_factory=dict)
    upcasts: int = 0
    reuses: int = 0


_SHARED_UPCASTS: ContextVar[UpcastCache | None] = ContextVar("bagel_shared_upcasts", default=None)


@contextlib.contextmanager
def shared_upcasts() -> Iterator[UpcastCache]:
    """Within this scope every low-precision layer upcasts its weight once per (dtype, device) and reuses it.

    The upcast weights stay alive until the scope closes, so scope it to what runs one layer several times:
    the branches of one step through one decoder layer (bounded by one layer's weights), or a whole step of a
    small model. A nested scope joins the open one.
    """
    active = _SHARED_UPCASTS.get()
    if active is not None:
        yield active
        return
    cache = UpcastCache()
    token = _SHARED_UPCASTS.set(cache)
    try:
        yield cache
    finally:
        _SHARED_UPCASTS.reset(token)
        cache.weights.clear()


class _LowPrecisionWeight(nn.Module):
    """Shared storage of a low-precision layer: ``weight`` in :attr:`storage` and, when scaled, ``weight_scale``.

    The constructor's ``dtype`` is the dtype of everything else the layer holds (a Linear's bias) and of its
    output when the input does not decide it (an Embedding without ``out_dtype``).
    """

    storage: torch.dtype = torch.bfloat16

    def _init_weight(self, shape: tuple[int, int], device, dtype: torch.dtype | None) -> None:
        self.compute_dtype = dtype if dtype is not None else torch.get_default_dtype()
        self.weight = nn.Parameter(torch.zeros(shape, dtype=self.storage, device=device), requires_grad=False)
        if self.storage in SCALED_STORAGE:
            scale = torch.ones(shape[0], dtype=torch.float32, device=device)
            self.weight_scale = nn.Parameter(scale, requires_grad=False)
        else:
            self.register_parameter("weight_scale", None)

    def load_weight(self, weight: Tensor) -> None:
        """Store a full-precision ``weight`` (the checkpoint's tensor) in this layer's storage, in place.

        The stored tensors land on the device ``weight`` is on.
        """
        if tuple(weight.shape) != tuple(self.weight.shape):
            raise ValueError(
                f"weight of shape {tuple(weight.shape)} given to a layer of shape {tuple(self.weight.shape)}"
            )
        data, scale = store_weight(weight, self.storage)
        self.weight = nn.Parameter(data, requires_grad=False)
        if scale is not None:
            self.weight_scale = nn.Parameter(scale, requires_grad=False)

    def _upcast(self, dtype: torch.dtype, device: torch.device, *, scale_output: bool) -> tuple[Tensor, Tensor | None]:
        cache = _SHARED_UPCASTS.get()
        if cache is None:
            return upcast_weight(self.weight, self.weight_scale, dtype, device, scale_output=scale_output)
        key = (self, dtype, device)
        found = cache.weights.get(key)
        if found is None:
            found = upcast_weight(self.weight, self.weight_scale, dtype, device, scale_output=scale_output)
            cache.weights[key] = found
            cache.upcasts += 1
        else:
            cache.reuses += 1
        return found


class LowPrecisionLinear(_LowPrecisionWeight):
    """``Linear`` with a low-precision weight upcast to the input's dtype at each call: ``x @ W^T * s + b``.

    An int8 layer called on the CPU with few rows (:data:`INT8_KERNEL_MAX_ROWS`, e.g. a decoding step) uses
    torch's int8 weight-only kernel instead of the upcast.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self._init_weight((out_features, in_features), device, dtype)
        if bias:
            self.bias = nn.Parameter(
                torch.zeros(out_features, dtype=self.compute_dtype, device=device), requires_grad=False
            )
        else:
            self.register_parameter("bias", None)

    def _int8_kernel_fits(self, x: Tensor) -> bool:
        """Whether ``x`` goes through torch's CPU int8 kernel (few rows, a width and dtype it handles)."""
        return (
            self.storage == torch.int8
            and x.device.type == "cpu"
            and self.weight.device.type == "cpu"
            and x.dtype in (torch.bfloat16, torch.float32)  # fp16: a small row's scale underflows
            and self.in_features % INT8_KERNEL_WIDTH_MULTIPLE == 0
            and x.numel() <= INT8_KERNEL_MAX_ROWS * self.in_features
        )

    def forward(self, x: Tensor) -> Tensor:
        """``x [..., in]`` → ``[..., out]`` in ``x``'s dtype."""
        if self._int8_kernel_fits(x):
            rows = x.reshape(-1, self.in_features).contiguous()
            out = torch._weight_int8pack_mm(rows, self.weight, self.weight_scale.to(x.dtype))
            out = out.reshape(*x.shape[:-1], self.out_features)
            return out if self.bias is None else out.add_(self.bias.to(x.device, x.dtype))
        weight, out_scale = self._upcast(x.dtype, x.device, scale_output=True)
        if out_scale is None:
            bias = None if self.bias is None else self.bias.to(x.device, x.dtype)
            return F.linear(x, weight, bias)
        out = F.linear(x, weight).mul_(out_scale)
        return out if self.bias is None else out.add_(self.bias.to(x.device, x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, storage={self.storage}"


class LowPrecisionEmbedding(_LowPrecisionWeight):
    """``Embedding`` with a low-precision table (one scale per row); only the looked-up rows are upcast."""

    def __init__(self, num_embeddings: int, embedding_dim: int, device=None, dtype=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self._init_weight((num_embeddings, embedding_dim), device, dtype)

    def forward(self, input: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
        """``input [...]`` int ids → ``[..., dim]`` in ``out_dtype`` (default: the constructor's ``dtype``)."""
        dtype = out_dtype if out_dtype is not None else self.compute_dtype
        ids = input.reshape(-1).to(self.weight.device)
        scale = None if self.weight_scale is None else self.weight_scale[ids]
        rows, _ = upcast_weight(F.embedding(ids, self.weight), scale, dtype, input.device, scale_output=False)
        return rows.reshape(*input.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, storage={self.storage}"


@functools.cache
def low_precision_operations(storage: torch.dtype) -> type:
    """The namespace whose ``Linear`` and ``Embedding`` store weights in ``storage`` (norms and convs: torch's).

    One class per storage dtype (cached), so layers built from it share their classes.
    """
    if storage not in STORAGE_DTYPES:
        raise ValueError(f"storage dtype {storage} is not supported; allowed: {STORAGE_DTYPES}")
    name = str(storage).removeprefix("torch.")
    linear = type(f"Linear_{name}", (LowPrecisionLinear,), {"storage": storage})
    embedding = type(f"Embedding_{name}", (LowPrecisionEmbedding,), {"storage": storage})
    return type(
        f"LowPrecisionOperations_{name}",
        (TorchOperations,),
        {
            "__doc__": f"Linear and Embedding weights stored as {name}, upcast per call.",
            "Linear": linear,
            "Embedding": embedding,
            "storage": storage,
        },
    )


def is_low_precision(module: nn.Module) -> bool:
    """Whether ``module`` is a low-precision layer (its checkpoint weight goes through ``load_weight``)."""
    return isinstance(module, _LowPrecisionWeight)


__all__ = [
    "COMPUTE_DTYPES",
    "INT8_KERNEL_MAX_ROWS",
    "LayerBuilder",
    "LowPrecisionEmbedding",
    "LowPrecisionLinear",
    "REQUIRED_LAYERS",
    "SCALED_STORAGE",
    "STORAGE_DTYPES",
    "TorchOperations",
    "UpcastCache",
    "check_compute_dtype",
    "check_operations",
    "is_low_precision",
    "low_precision_operations",
    "shared_upcasts",
    "store_weight",
    "upcast_weight",
]
