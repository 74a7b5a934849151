"""Load a BAGEL checkpoint folder (official layout) into :class:`Bagel` + :class:`AutoEncoder`.

Only JSON and safetensors files are read. The model is built on the meta device, every tensor name
and shape in the files is checked against the model first (any mismatch is a
:class:`~unicache_core.errors.CheckpointError` that lists the offending names), then the tensors are
assigned in place (no second copy of the weights). The VAE is always kept in fp32, as officially.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import safe_open

from ..errors import CheckpointError
from .config import BagelConfig, load_bagel_config
from .modeling import AutoEncoder, Bagel
from .tokenizer import BagelTokenizer

logger = logging.getLogger(__name__)

EMA_FILE = "ema.safetensors"
AE_FILE = "ae.safetensors"
ALLOWED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_LISTED = 20


@dataclass
class LoadedBagel:
    """Everything a pipeline needs from one checkpoint folder."""

    model: Bagel
    vae: AutoEncoder
    tokenizer: BagelTokenizer
    config: BagelConfig
    checkpoint_dir: Path
    dtype: torch.dtype
    device: torch.device


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    more = f" … and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
    return f"{len(names)}: {shown}{more}"


#: Suffixes of pickle-based weight files (``torch.save``): never opened by this loader.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
#: First bytes of a ``torch.save`` zip archive and of a raw pickle stream (protocol 2+).
_PICKLE_MAGICS = (b"PK\x03\x04", b"\x80")


def _check_weights_file(path: Path) -> None:
    """Raise a :class:`CheckpointError` if ``path`` is missing or is a pickle file (only 8 bytes are read)."""
    if not path.is_file():
        pickles = sorted(p.name for p in path.parent.glob("*") if p.suffix.lower() in PICKLE_SUFFIXES)
        found = (
            f"; the folder has pickle-based weights ({', '.join(pickles)}), which are not read because "
            f"unpickling can run arbitrary code: this loader needs safetensors, so download {path.name} or "
            f"convert those weights to safetensors"
            if pickles
            else ""
        )
        raise CheckpointError(
            f"missing weights file {path}; download {path.name} of ByteDance-Seed/BAGEL-7B-MoT into "
            f"{path.parent}{found}"
        )
    with open(path, "rb") as fh:
        head = fh.read(8)
    if head.startswith(_PICKLE_MAGICS):
        raise CheckpointError(
            f"{path} is a pickle/torch.save file, not safetensors; it is not read because unpickling can run "
            f"arbitrary code. Download the real {path.name} or convert the weights to safetensors"
        )


def _read_safetensors(
    path: Path, expected: Mapping[str, torch.Size], *, device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Check names/shapes of ``path`` against ``expected``, then read every tensor as ``dtype`` on ``device``."""
    _check_weights_file(path)
    load_device = "cpu" if device.type == "meta" else str(device)
    try:
        with safe_open(str(path), framework="pt", device=load_device) as fh:
            names = list(fh.keys())
            shapes = {name: torch.Size(fh.get_slice(name).get_shape()) for name in names}
            missing = sorted(set(expected) - set(names))
            unexpected = sorted(set(names) - set(expected))
            if missing or unexpected:
                parts = []
                if missing:
                    parts.append(f"missing keys {_listing(missing)}")
                if unexpected:
                    parts.append(f"unexpected keys {_listing(unexpected)}")
                raise CheckpointError(
                    f"{path} does not match the model built from the config files: {'; '.join(parts)}. "
                    f"Check that the folder's config JSON files belong to these weights"
                )
            for name in names:
                if shapes[name] != expected[name]:
                    raise CheckpointError(
                        f"{path}: tensor {name!r} has shape {tuple(shapes[name])}, the config expects "
                        f"{tuple(expected[name])}; the config JSON files do not match these weights"
                    )
            tensors = {}
            for name in names:
                tensor = fh.get_tensor(name)
                if not tensor.is_floating_point():
                    raise CheckpointError(f"{path}: tensor {name!r} has non-float dtype {tensor.dtype}")
                tensors[name] = tensor.to(dtype)
            return tensors
    except (CheckpointError, MemoryError, torch.OutOfMemoryError):
        raise  # out of memory is not file corruption: keep the real error
    except Exception as exc:  # safetensors raises several types for corrupt/truncated files
        raise CheckpointError(
            f"cannot read {path}: {type(exc).__name__}: {exc}. The file is corrupt or truncated; re-download it"
        ) from None


def _expected_shapes(module: torch.nn.Module) -> dict[str, torch.Size]:
    return {name: t.shape for name, t in module.state_dict().items()}


def _assign(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    result = module.load_state_dict(tensors, strict=False, assign=True)
    if result.missing_keys or result.unexpected_keys:  # cannot happen after the check above
        raise CheckpointError(
            f"internal error: state dict mismatch after checking ({result.missing_keys}, {result.unexpected_keys})"
        )
    for param in module.parameters():
        param.requires_grad_(False)


def _parse_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, str):
        aliases = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
                   "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}
        if dtype.lower() not in aliases:
            raise ValueError(f"`dtype` {dtype!r} is not supported; allowed: {sorted(aliases)}")
        return aliases[dtype.lower()]
    if dtype not in ALLOWED_DTYPES:
        raise ValueError(f"`dtype` {dtype!r} is not supported; allowed: {ALLOWED_DTYPES}")
    return dtype


def _parse_device(device: Any) -> torch.device:
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
            f"`offload_folder` is required: the device map puts {_listing(on_disk)} on 'disk'; pass "
            f"offload_folder=<a writable folder with room for those weights>"
        )
    if offload_folder is not None:
        offload_folder.mkdir(parents=True, exist_ok=True)
    # accelerate's rule: the first device that is neither 'cpu' nor 'disk' runs the offloaded modules.
    first = next((dev for dev in device_map.values() if str(dev) not in ("cpu", "disk")), "cpu")
    main_device = torch.device("cuda", first) if isinstance(first, int) else torch.device(first)
    model = accelerate.dispatch_model(
        model, device_map=device_map, main_device=str(main_device),
        offload_dir=str(offload_folder) if offload_folder is not None else None,
    )
    model.execution_device = main_device
    return model


def load_bagel(
    checkpoint_dir: str | Path,
    *,
    dtype: torch.dtype | str = torch.bfloat16,
    device: torch.device | str = "cpu",
    device_map: Any = None,
    offload_folder: str | Path | None = None,
    max_memory: Mapping[Any, Any] | None = None,
) -> LoadedBagel:
    """Load model, VAE, tokenizer and config from a BAGEL checkpoint folder.

    Args:
        checkpoint_dir: folder with ``llm_config.json``, ``vit_config.json``, ``ema.safetensors``,
            ``ae.safetensors``, ``vocab.json``, ``merges.txt``, ``tokenizer_config.json``
            (``ae_config.json`` optional).
        dtype: dtype of the BAGEL weights (bf16, fp16 or fp32); the VAE is always fp32.
        device: device of the model and the VAE (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...); checked to
            exist before anything is read.
        device_map: optional accelerate device map (``"auto"`` or ``{module_name: device}``) to spread
            the BAGEL model over devices, ``"cpu"`` and ``"disk"``; needs ``accelerate``. The VAE still
            goes to ``device``. Outputs are identical to an unsplit model (same seed).
        offload_folder: folder for the weights a device map puts on ``"disk"`` (required then).
        max_memory: with ``device_map="auto"``: accelerate's ``{device: bytes or "10GiB"}`` budget.

    Raises:
        CheckpointError: missing/corrupt/mismatching files, pickle files instead of safetensors.
        ValueError: unsupported ``dtype``, unavailable ``device``, bad ``device_map`` arguments.
    """
    root = Path(checkpoint_dir)
    dtype = _parse_dtype(dtype)
    device = _parse_device(device)
    if max_memory is not None and device_map != "auto":
        raise ValueError(f"`max_memory` is only used with device_map='auto', got device_map={device_map!r}")
    if max_memory is not None and not isinstance(max_memory, Mapping):
        raise ValueError(f"`max_memory` must be a mapping device -> size such as {{'cpu': '8GiB'}}, got {max_memory!r}")
    folder = Path(offload_folder) if offload_folder is not None else None
    config = load_bagel_config(root)
    tokenizer = BagelTokenizer.from_dir(root)
    if tokenizer.vocab_size > config.llm.vocab_size:
        raise CheckpointError(
            f"the tokenizer in {root} has {tokenizer.vocab_size} ids but llm_config.json says vocab_size="
            f"{config.llm.vocab_size}; the tokenizer files do not belong to this model"
        )

    with torch.device("meta"):
        model = Bagel(config)
        vae = AutoEncoder(config.ae)
    load_device = torch.device("cpu") if device_map is not None else device
    _assign(model, _read_safetensors(root / EMA_FILE, _expected_shapes(model), device=load_device, dtype=dtype))
    _assign(vae, _read_safetensors(root / AE_FILE, _expected_shapes(vae), device=device, dtype=torch.float32))
    model.reset_buffers(load_device)
    model.eval()
    vae.eval()
    if device_map is not None:
        model = _dispatch(model, device_map, dtype, folder, max_memory)
    logger.info("loaded BAGEL from %s (%s on %s)", root, dtype, device)
    return LoadedBagel(
        model=model,
        vae=vae,
        tokenizer=tokenizer,
        config=config,
        checkpoint_dir=root,
        dtype=dtype,
        device=device,
    )


__all__ = ["LoadedBagel", "load_bagel"]
