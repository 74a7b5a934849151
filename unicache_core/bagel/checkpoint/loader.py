"""Load a BAGEL checkpoint (official folder, or one converted ``.safetensors`` file) into :class:`Bagel` +
:class:`AutoEncoder`.

The single-file form (:mod:`.single_file`) holds no VAE and no tokenizer: the tokenizer comes from a
folder (``tokenizer_dir``) and the VAE is optional (``vae``). Everything below applies to both forms.

Only JSON and safetensors files are read. The form is inspected first (:func:`~.folder.inspect_folder`,
:func:`~.single_file.inspect_single_file`): the configs, the tokenizer and the safetensors headers
(:func:`~.header.read_header`, no tensor data), and the configs are checked against the headers
(:mod:`.config_check`: layer and block counts and the main widths), so no config value can make the
loader build or allocate without bound. The model is then built on the meta device, every tensor name
and shape in the files is checked against it (any mismatch is a
:class:`~unicache_core.errors.CheckpointError` that lists the offending names), and the tensors are read
one at a time, each assigned in place as soon as it is read (no second copy of the weights, no dict of
a whole file). Every floating tensor is
checked to be finite, both as stored and after the cast to the model dtype: a corrupt tensor or an
fp16 overflow is a :class:`~unicache_core.errors.NumericalError` naming the tensor and the file. The
VAE is always kept in fp32, as officially.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...errors import CheckpointError
from ...sizes import parse_size
from ..config import AE_CONFIG_FILE, BagelConfig
from ..modeling import AutoEncoder, Bagel
from ..modeling.operations import check_operations
from ..numerics import check_weight
from ..offload import LayerOffload, apply_layer_offload
from ..tokenizer import BagelTokenizer
from ..weight_layout import bagel_layout, vae_layout
from ..weights import (
    HostOperations,
    assign_checkpoint_tensor,
    build_bagel,
    checkpoint_shapes,
    parse_weight_dtype,
    plain_storage_dtype,
)
from .config_check import check_names_and_shapes, check_vae_config, listing
from .folder import inspect_folder
from .header import SafetensorsHeader, read_header
from .single_file import check_single_file_name, check_tokenizer, inspect_single_file
from .tensor_file import TensorFile

logger = logging.getLogger(__name__)

ALLOWED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass
class LoadedBagel:
    """Everything a pipeline needs from one checkpoint (folder or single file).

    Attributes:
        vae: the checkpoint's FLUX VAE, or ``None`` for a single file loaded without one (then every
            pipeline call that encodes or decodes needs an external VAE, see :class:`BagelPipeline`).
        checkpoint_dir: the checkpoint folder, or the ``.safetensors`` file of a single-file checkpoint.
        form: ``"folder"`` or ``"single_file"``.
        model_id: the id policy tables and reports use (:mod:`unicache_core.bagel.checkpoint.model_id`); ``""`` =
        unknown. variant: the single file's metadata ``variant`` (``None`` for a folder). metadata: the single file's
        ``comfyui_bagel`` metadata (``None`` for a folder). tokenizer_dir: where the tokenizer files were read (the
        folder itself for the folder form). weight_dtype: how the Linear/Embedding weights are stored
        (:data:`~..weights.WEIGHT_DTYPES`; ``dtype`` is
            the compute dtype they are upcast to).
        offload: the layer offload handle with ``offload="layers"`` (:mod:`..offload`), else ``None``.
    """

    model: Bagel
    vae: AutoEncoder | None
    tokenizer: BagelTokenizer
    config: BagelConfig
    checkpoint_dir: Path
    dtype: torch.dtype
    device: torch.device
    form: str = "folder"
    model_id: str = ""
    variant: str | None = None
    metadata: dict | None = None
    tokenizer_dir: Path | None = None
    weight_dtype: str = "auto"
    offload: LayerOffload | None = None


def _read_tensor(file: TensorFile, name: str) -> torch.Tensor:
    """Tensor ``name`` of ``file`` as stored; a non-float tensor is refused."""
    stored = file.read(name)
    if not stored.is_floating_point():
        raise CheckpointError(f"{file.header.path}: tensor {name!r} has non-float dtype {stored.dtype}")
    return stored


def _placed_tensor(module: torch.nn.Module, name: str) -> torch.Tensor:
    owner_name, _, leaf = name.rpartition(".")
    return getattr(module.get_submodule(owner_name), leaf)


def _load_weights(module: torch.nn.Module, header: SafetensorsHeader, *, device: torch.device) -> None:
    """Check the names/shapes of ``header`` against ``module`` (built on the meta device), then read its tensors
    one at a time, each converted to the storage ``module`` declares for it, placed on ``device`` and checked
    to be finite before the next is read (:func:`~..weights.assign_checkpoint_tensor`)."""
    check_names_and_shapes(header, checkpoint_shapes(module))
    with TensorFile(header) as file:
        for name in sorted(header.tensors):
            stored = _read_tensor(file, name)
            if device.type != "cpu":
                stored = stored.to(device)  # convert (quantize) where the model will compute
            assign_checkpoint_tensor(module, name, stored, device=device)
            placed = _placed_tensor(module, name)
            # NaN/inf in the file, or overflow of a float storage (e.g. fp16); fp8/int8 rows are scaled to fit
            check_weight(header.path, name, stored, placed if placed.dtype in ALLOWED_DTYPES else stored)
            del stored, placed


def parse_dtype(dtype: Any) -> torch.dtype:
    """``dtype`` (a torch dtype, or ``"bf16"``/``"fp16"``/``"fp32"`` and their long names) -> torch dtype."""
    if isinstance(dtype, str):
        aliases = {
            "bf16": torch.bfloat16,
            "bfloat16": torch.bfloat16,
            "fp16": torch.float16,
            "float16": torch.float16,
            "fp32": torch.float32,
            "float32": torch.float32,
        }
        if dtype.lower() not in aliases:
            raise ValueError(f"`dtype` {dtype!r} is not supported; allowed: {sorted(aliases)}")
        return aliases[dtype.lower()]
    if dtype not in ALLOWED_DTYPES:
        raise ValueError(f"`dtype` {dtype!r} is not supported; allowed: {ALLOWED_DTYPES}")
    return dtype


#: ``offload`` values of :func:`load_bagel` (and ``--offload``).
OFFLOAD_MODES = ("none", "layers")


def parse_offload(value: Any) -> str:
    """An ``offload`` value (``"none"``/``"layers"``, or ``None`` for none) checked."""
    if value is None:
        return "none"
    if isinstance(value, str) and value.lower() in OFFLOAD_MODES:
        return value.lower()
    raise ValueError(f"`offload` {value!r} is not supported; choose one of {', '.join(OFFLOAD_MODES)}")


def parse_device(device: Any) -> torch.device:
    """``device`` → :class:`torch.device`, checking that the backend exists on this machine."""
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"`device` must be a str or torch.device such as 'cpu' or 'cuda:0', got {device!r}")
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"`device` {device!r} is not a torch device; use e.g. 'cpu', 'cuda' or 'cuda:1'") from None
    if parsed.type == "cpu":
        return torch.device("cpu")  # 'cpu:0' is the same device; safetensors only accepts 'cpu'
    if parsed.type == "meta":
        raise ValueError("`device` 'meta' holds no data; load on 'cpu' or a GPU (or use `device_map` to offload)")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"`device` {str(parsed)!r}: CUDA is not available in this torch build/machine "
                f"(torch.cuda.is_available() is False); use device='cpu'"
            )
        count = torch.cuda.device_count()
        if parsed.index is not None and parsed.index >= count:
            raise ValueError(f"`device` {str(parsed)!r}: only {count} CUDA device(s) (indices 0..{count - 1})")
        return parsed
    backend = getattr(torch, parsed.type, None) if parsed.type != "mps" else getattr(torch.backends, "mps", None)
    is_available = getattr(backend, "is_available", None)
    if is_available is None or not is_available():
        raise ValueError(f"`device` {str(parsed)!r}: the {parsed.type!r} backend is not available here; use 'cpu'")
    return parsed


def _dispatch(
    model: Bagel,
    device_map: Any,
    dtype: torch.dtype,
    offload_folder: Path | None,
    max_memory: Mapping[Any, Any] | None,
) -> Bagel:
    try:
        import accelerate
    except ImportError as exc:
        raise ImportError(
            "`device_map` needs the `accelerate` package; install it with `pip install accelerate` "
            "(or `pip install comfyui-unicache-bagel[offload]`), or pass device_map=None"
        ) from exc
    if device_map == "auto":
        device_map = accelerate.infer_auto_device_map(
            model,
            max_memory=dict(max_memory) if max_memory is not None else None,
            no_split_module_classes=["Qwen2MoTDecoderLayer", "SiglipEncoderLayer"],
            dtype=dtype,
        )
    elif not isinstance(device_map, Mapping):
        raise ValueError(f"`device_map` must be None, 'auto' or a mapping module-name -> device, got {device_map!r}")
    device_map = dict(device_map)
    on_disk = sorted(name for name, dev in device_map.items() if dev == "disk")
    if on_disk and offload_folder is None:
        raise ValueError(
            f"`offload_folder` is required: the device map puts {listing(on_disk)} on 'disk'; pass "
            f"offload_folder=<a writable folder with room for those weights>"
        )
    if offload_folder is not None:
        offload_folder.mkdir(parents=True, exist_ok=True)
    # accelerate's rule: the first device that is neither 'cpu' nor 'disk' runs the offloaded modules.
    first = next((dev for dev in device_map.values() if str(dev) not in ("cpu", "disk")), "cpu")
    main_device = torch.device("cuda", first) if isinstance(first, int) else torch.device(first)
    model = accelerate.dispatch_model(
        model,
        device_map=device_map,
        main_device=str(main_device),
        offload_dir=str(offload_folder) if offload_folder is not None else None,
    )
    model.execution_device = main_device
    return model


@dataclass(frozen=True)
class _Placement:
    """Where and how the weights go: :func:`load_bagel`'s checked ``dtype``/``device``/device-map arguments."""

    dtype: torch.dtype
    device: torch.device
    device_map: Any
    offload_folder: Path | None
    max_memory: Mapping[Any, Any] | None
    weight_dtype: str = "auto"
    offload: str = "none"
    operations: Any = None


def _build_and_read(
    config: BagelConfig, ema: SafetensorsHeader, ae: SafetensorsHeader | None, placement: _Placement, where: Path
) -> tuple[Bagel, AutoEncoder | None, LayerOffload | None]:
    """Build on the meta device with the weight storage of ``placement``, check every name/shape, read each file
    once tensor by tensor and assign in place (``where``: the checkpoint, named when the config cannot be
    built); then dispatch or offload as ``placement`` says. Every name and shape of the files is checked against
    the config's layout (:mod:`..weight_layout`) before any module is built."""
    check_names_and_shapes(ema, bagel_layout(config).checkpoint_shapes())
    if ae is not None:
        check_names_and_shapes(ae, {spec.name: spec.shape for spec in vae_layout(config.ae)})
    try:
        model = build_bagel(
            config,
            weight_dtype=placement.weight_dtype,
            dtype=placement.dtype,
            device="meta",
            operations=placement.operations,
        )
        with torch.device("meta"):
            vae = None
            if ae is not None:  # fp32 in any namespace: the VAE always computes in fp32
                vae = AutoEncoder(
                    config.ae,
                    operations=placement.operations,
                    dtype=None if placement.operations is None else torch.float32,
                )
    except (RuntimeError, ValueError, OverflowError) as exc:  # e.g. a width whose storage size overflows
        raise CheckpointError(
            f"cannot build the model described by the config files of {where}: {type(exc).__name__}: {exc}; "
            f"check the config JSON (re-download or re-convert the checkpoint)"
        ) from None
    on_host = placement.device_map is not None or placement.offload != "none"
    load_device = torch.device("cpu") if on_host else placement.device
    _load_weights(model, ema, device=load_device)
    if vae is not None and ae is not None:  # vae is built exactly when there is an ae file
        _load_weights(vae, ae, device=placement.device)  # built with fp32 tensors: the VAE stays fp32
        vae.requires_grad_(False)
        vae.eval()
    model.reset_buffers(load_device)
    model.eval()
    offload = None
    if placement.device_map is not None:
        model = _dispatch(model, placement.device_map, placement.dtype, placement.offload_folder, placement.max_memory)
    elif placement.offload == "layers":
        offload = apply_layer_offload(model, placement.device)
    return model, vae, offload


def load_bagel(
    checkpoint: str | Path,
    *,
    dtype: torch.dtype | str = torch.bfloat16,
    device: torch.device | str = "cpu",
    device_map: Any = None,
    offload_folder: str | Path | None = None,
    max_memory: Mapping[Any, Any] | None = None,
    tokenizer_dir: str | Path | None = None,
    vae: str | Path | None = None,
    weight_dtype: Any = "auto",
    offload: str = "none",
) -> LoadedBagel:
    """Load model, VAE, tokenizer and config from a BAGEL checkpoint folder or single ``.safetensors`` file.

    Args:
        checkpoint: either the official folder (``llm_config.json``, ``vit_config.json``,
            ``ema.safetensors``, ``ae.safetensors``, ``vocab.json``, ``merges.txt``,
            ``tokenizer_config.json``; ``ae_config.json`` optional), or one converted ``.safetensors``
            file (ComfyUI-BAGEL's single-file form, :mod:`.single_file`: the ``ema`` tensors with configs in
            its metadata or a sidecar; no VAE and no tokenizer inside).
        dtype: the compute dtype of BAGEL (bf16, fp16 or fp32): hidden states, norms, biases; also the
            weights' storage with ``weight_dtype="auto"``. The VAE is always fp32.
        device: device of the model and the VAE (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...); checked to
            exist before anything is read.
        device_map: optional accelerate device map (``"auto"`` or ``{module_name: device}``) to spread
            the BAGEL model over devices, ``"cpu"`` and ``"disk"``; needs ``accelerate``. The VAE still
            goes to ``device``. Outputs are identical to an unsplit model (same seed).
        offload_folder: folder for the weights a device map puts on ``"disk"`` (required then).
        max_memory: with ``device_map="auto"``: accelerate's ``{device: bytes or "10GiB"}`` budget.
        tokenizer_dir: single file only (required there): folder with ``vocab.json``, ``merges.txt``
            and ``tokenizer_config.json`` (e.g. ComfyUI's ``comfy/text_encoders/qwen25_tokenizer``);
            BAGEL's special tokens must sit at the ids the checkpoint expects (checked).
        vae: single file only: a FLUX ``ae.safetensors`` to load as the VAE, or ``None`` (the result's
            ``vae`` is then ``None`` and the pipeline needs an external VAE to encode/decode).
        weight_dtype: how BAGEL's Linear/Embedding weights are stored (``auto``, ``bf16``, ``fp16``, ``fp32``,
            ``fp8_e4m3fn``, ``fp8_e5m2``, ``int8``; :mod:`..weights`): each is upcast to ``dtype`` at every call.
            Or a :class:`~..weights.HostOperations`: the layers of BAGEL and its VAE are then the host's (e.g.
            ComfyUI's ``comfy.ops.pick_operations(...)``), storing the weights as its ``weight_dtype`` by a plain
            cast (``auto``: ``dtype``; ``int8`` refused) and casting them per call; the VAE's in fp32.
        offload: ``"none"`` or ``"layers"``: keep the decoder layers in host memory and bring each to
            ``device`` just before it runs (:func:`~..offload.apply_layer_offload`; needs ``accelerate``).

    Only headers are read before the configs are validated against them; each weight file's data is
    read once, tensor by tensor with plain reads (:mod:`.tensor_file`), each converted to its storage and
    placed before the next is read: host memory peaks near the loaded model plus one tensor.

    Raises:
        CheckpointError: missing/corrupt/mismatching files, pickle files instead of safetensors, a config
            that does not describe the weight files (checked on the headers before anything is built);
            for a single file also refused metadata (format version, variant, quantization, dtype), a
            sidecar of another file, no metadata and not BAGEL-7B-MoT's layout, a tokenizer whose
            special-token ids differ from the checkpoint's.
        NumericalError: a weight holds NaN/inf in the file, or overflows ``dtype`` (e.g. fp16).
        ValueError: unsupported ``dtype``/``weight_dtype``/``offload``, unavailable ``device``, bad
            ``device_map`` arguments or a ``device_map`` with ``offload``; a single
            file without ``tokenizer_dir``, or ``tokenizer_dir``/``vae`` given with a folder; a
            :class:`~..weights.HostOperations` whose namespace lacks a layer class, or with ``int8``.
    """
    root = Path(checkpoint)
    dtype = parse_dtype(dtype)
    device = parse_device(device)
    if max_memory is not None and device_map != "auto":
        raise ValueError(f"`max_memory` is only used with device_map='auto', got device_map={device_map!r}")
    if max_memory is not None and not isinstance(max_memory, Mapping):
        raise ValueError(f"`max_memory` must be a mapping device -> size such as {{'cpu': '8GiB'}}, got {max_memory!r}")
    if max_memory is not None:  # byte counts for accelerate, each read by the one size parser
        max_memory = {
            key: parse_size(size, f"`max_memory`[{key!r}]", example="8GiB") for key, size in max_memory.items()
        }
    operations = None
    if isinstance(weight_dtype, HostOperations):
        operations, weight_dtype = check_operations(weight_dtype.operations), weight_dtype.weight_dtype
        plain_storage_dtype(weight_dtype, dtype)  # int8 refused before any file is read
    weight_dtype = parse_weight_dtype(weight_dtype)
    offload = parse_offload(offload)
    if offload != "none" and device_map is not None:
        raise ValueError(f"`offload` {offload!r} and `device_map` both place the weights; pass only one of them")
    placement = _Placement(
        dtype,
        device,
        device_map,
        Path(offload_folder) if offload_folder is not None else None,
        max_memory,
        weight_dtype,
        offload,
        operations,
    )
    if root.is_file():
        return _load_single_file(root, tokenizer_dir, vae, placement)
    if not root.exists():
        raise CheckpointError(
            f"checkpoint {root} does not exist; pass a BAGEL checkpoint folder (llm_config.json, vit_config.json, "
            f"ema.safetensors, ae.safetensors, tokenizer files) or a single converted .safetensors file"
        )
    if tokenizer_dir is not None or vae is not None:
        given = " and ".join(n for n, v in (("`tokenizer_dir`", tokenizer_dir), ("`vae`", vae)) if v is not None)
        raise ValueError(
            f"{given}: only for a single-file checkpoint; the folder {root} brings its own tokenizer and "
            f"ae.safetensors (pass an external VAE to BagelPipeline(..., vae=...) instead)"
        )
    folder = inspect_folder(root)  # headers only: the config must describe these files before anything is built
    model, ae, handle = _build_and_read(folder.config, folder.ema, folder.ae, placement, root)
    logger.info("loaded BAGEL from %s (%s on %s, weights %s, offload %s)", root, dtype, device, weight_dtype, offload)
    return LoadedBagel(
        model=model,
        vae=ae,
        tokenizer=folder.tokenizer,
        config=folder.config,
        checkpoint_dir=root,
        dtype=dtype,
        device=device,
        form="folder",
        model_id=folder.model_id,
        tokenizer_dir=root,
        weight_dtype=weight_dtype,
        offload=handle,
    )


def _load_single_file(
    path: Path, tokenizer_dir: str | Path | None, vae: str | Path | None, placement: _Placement
) -> LoadedBagel:
    """:func:`load_bagel` of a single ``.safetensors`` file (see :mod:`.single_file`)."""
    check_single_file_name(path)
    if tokenizer_dir is None:
        raise ValueError(
            f"`tokenizer_dir` is required for the single-file checkpoint {path} (it holds no tokenizer): pass the "
            f"folder with vocab.json, merges.txt and tokenizer_config.json, e.g. ComfyUI's "
            f"comfy/text_encoders/qwen25_tokenizer for BAGEL-7B-MoT"
        )
    if vae is not None and not isinstance(vae, (str, Path)):
        raise ValueError(
            f"`vae` must be the path of a FLUX ae.safetensors or None, got {type(vae).__name__}; pass a VAE adapter "
            f"object to BagelPipeline(..., vae=...) instead"
        )
    info = inspect_single_file(path)  # header (and sidecar) only; configs checked against it
    tok_dir = Path(tokenizer_dir)
    if not tok_dir.is_dir():
        raise CheckpointError(
            f"`tokenizer_dir` {tok_dir} is not a folder; pass the folder holding vocab.json, merges.txt and "
            f"tokenizer_config.json"
        )
    tokenizer = BagelTokenizer.from_dir(tok_dir)
    check_tokenizer(tokenizer, info, tok_dir)
    config = info.config
    ae = None
    if vae is not None:
        ae = read_header(Path(vae))
        has_ae = AE_CONFIG_FILE in (info.metadata.get("model_configs") or {})
        check_vae_config(
            config.ae,
            ae,
            source=f"{path.name}[{info.source}]:{AE_CONFIG_FILE}" if has_ae else "the built-in FLUX VAE config",
        )
    model, vae_module, handle = _build_and_read(config, info.header, ae, placement, path)
    logger.info(
        "loaded BAGEL %s from the single file %s (%s on %s, VAE: %s)",
        info.variant,
        path,
        placement.dtype,
        placement.device,
        ae.path if ae is not None else "none",
    )
    return LoadedBagel(
        model=model,
        vae=vae_module,
        tokenizer=tokenizer,
        config=config,
        checkpoint_dir=path,
        dtype=placement.dtype,
        device=placement.device,
        form="single_file",
        model_id=info.model_id,
        variant=info.variant,
        metadata=info.metadata,
        tokenizer_dir=tok_dir,
        weight_dtype=placement.weight_dtype,
        offload=handle,
    )


__all__ = ["OFFLOAD_MODES", "LoadedBagel", "load_bagel", "parse_device", "parse_dtype", "parse_offload"]
