"""Load a BAGEL checkpoint (official folder, or one converted ``.safetensors`` file) into :class:`Bagel` +
:class:`AutoEncoder`.

The single-file form (:mod:`.single_file`) holds no VAE and no tokenizer: the tokenizer comes from a
folder (``tokenizer_dir``) and the VAE is optional (``vae``). Everything below applies to both forms.

Only JSON and safetensors files are read. Before any module is built, the config is checked against
the safetensors headers (names and shapes only; no tensor data): the layer and block counts and the
main widths must match, so no config value can make the loader build or allocate without bound. The
model is then built on the meta device, every tensor name and shape in the files is checked against
it (any mismatch is a :class:`~unicache_core.errors.CheckpointError` that lists the offending names),
and the tensors are assigned in place (no second copy of the weights). Every floating tensor is
checked to be finite, both as stored and after the cast to the model dtype: a corrupt tensor or an
fp16 overflow is a :class:`~unicache_core.errors.NumericalError` naming the tensor and the file. The
VAE is always kept in fp32, as officially.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import safe_open

from ...errors import CheckpointError, UniCacheError
from .model_id import model_id_of
from ..config import AE_CONFIG_FILE, LLM_CONFIG_FILE, VIT_CONFIG_FILE, BagelConfig, load_bagel_config
from ..modeling import AutoEncoder, Bagel
from ..numerics import check_weight
from ..tokenizer import BagelTokenizer

logger = logging.getLogger(__name__)

EMA_FILE = "ema.safetensors"
AE_FILE = "ae.safetensors"
ALLOWED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_LISTED = 20


@dataclass
class LoadedBagel:
    """Everything a pipeline needs from one checkpoint (folder or single file).

    Attributes:
        vae: the checkpoint's FLUX VAE, or ``None`` for a single file loaded without one (then every
            pipeline call that encodes or decodes needs an external VAE, see :class:`BagelPipeline`).
        checkpoint_dir: the checkpoint folder, or the ``.safetensors`` file of a single-file checkpoint.
        form: ``"folder"`` or ``"single_file"``.
        model_id: the id policy tables and reports use (:mod:`unicache_core.bagel.checkpoint.model_id`); ``""`` = unknown.
        variant: the single file's metadata ``variant`` (``None`` for a folder).
        metadata: the single file's ``comfyui_bagel`` metadata (``None`` for a folder).
        tokenizer_dir: where the tokenizer files were read (the folder itself for the folder form).
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


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    more = f" … and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
    return f"{len(names)}: {shown}{more}"


#: Suffixes of pickle-based weight files (``torch.save``): never opened by this loader.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
#: First bytes of a ``torch.save`` zip archive.
_ZIP_MAGIC = b"PK\x03\x04"
#: Protocols a raw pickle stream announces after its ``0x80`` PROTO opcode.
_PICKLE_PROTOCOLS = range(2, 6)


def _looks_like_safetensors(head: bytes, size: int) -> bool:
    """Whether ``head`` (the first 9 bytes of a ``size``-byte file) opens a safetensors file.

    A safetensors file starts with its header length as a little-endian u64 and then the JSON header's
    ``{``. The length's low byte may be anything (``0x80`` included, the first byte of a pickle stream),
    so the format is told by the whole prefix, not by its first byte.
    """
    if len(head) < 9:
        return False
    header_len = int.from_bytes(head[:8], "little")
    return 2 <= header_len <= size - 8 and head[8:9] == b"{"


def _is_pickle(head: bytes) -> bool:
    """A ``torch.save`` zip archive or a raw pickle stream (PROTO opcode ``0x80`` and protocol 2..5)."""
    return head.startswith(_ZIP_MAGIC) or (len(head) >= 2 and head[0] == 0x80 and head[1] in _PICKLE_PROTOCOLS)


def _check_weights_file(path: Path) -> None:
    """Raise a :class:`CheckpointError` if ``path`` is missing or is a pickle file (only 9 bytes are read)."""
    if path.exists() and not path.is_file():
        kind = "a directory" if path.is_dir() else "not a regular file"
        raise CheckpointError(
            f"weights file {path} is {kind}; replace it with {path.name} of ByteDance-Seed/BAGEL-7B-MoT"
        )
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
        head = fh.read(9)
    if not _looks_like_safetensors(head, path.stat().st_size) and _is_pickle(head):
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
                    f"Check that the config JSON (the folder's files, or a single file's metadata) belongs to "
                    f"these weights"
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
                check_weight(path, name, tensor, tensors[name])  # NaN/inf in the file, or overflow of `dtype`
            return tensors
    except (UniCacheError, MemoryError, torch.OutOfMemoryError):
        raise  # out of memory is not file corruption: keep the real error
    except Exception as exc:  # safetensors raises several types for corrupt/truncated files
        raise CheckpointError(
            f"cannot read {path}: {type(exc).__name__}: {exc}. The file is corrupt or truncated; re-download it"
        ) from None


def read_header(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a safetensors file, from its header only (no tensor data is read)."""
    _check_weights_file(path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            return {name: tuple(fh.get_slice(name).get_shape()) for name in fh.keys()}
    except (MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as exc:  # safetensors raises several types for corrupt/truncated files
        raise CheckpointError(
            f"cannot read {path}: {type(exc).__name__}: {exc}. The file is corrupt or truncated; re-download it"
        ) from None


def _indices(names: Mapping[str, object], prefix: str) -> set[int]:
    """The ``N`` of every ``{prefix}N.`` name (module-list indices present in a header)."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    found = set()
    for name in names:
        match = pattern.match(name)
        if match:
            found.add(int(match.group(1)))
    return found


def check_config_against_headers(
    config: BagelConfig,
    root: Path,
    ema: Mapping[str, tuple[int, ...]],
    ae: Mapping[str, tuple[int, ...]] | None,
    *,
    ema_path: Path | None = None,
    ae_path: Path | None = None,
    llm_source: str | None = None,
    vit_source: str | None = None,
    ae_source: str | None = None,
) -> None:
    """Refuse a config whose layer/block counts or main widths disagree with the weight files' headers.

    Runs before any module is built: building follows the config, so a config saying
    ``num_hidden_layers: 10000000`` or ``hidden_size: 2**40`` must fail here (cheaply) rather than make
    the loader build millions of modules or overflow. Checked: LLM layers, vocabulary and width,
    MLP width, attention widths; ViT layers, width, MLP width, patch and position table; VAE levels
    and blocks per level, base width and latent channels. Everything else is then checked exactly
    against the meta-built model (whose size is now bounded by the files).

    The defaults describe a checkpoint folder ``root``; a single-file checkpoint passes its file as
    ``ema_path``, the VAE file as ``ae_path`` (``ae`` None: no VAE, its checks are skipped) and names
    where its configs came from (``*_source``, used in the messages).
    """
    llm, vit, aec = config.llm, config.vit, config.ae
    ema_path = root / EMA_FILE if ema_path is None else ema_path
    ae_path = root / AE_FILE if ae_path is None else ae_path
    if ae_source is None:
        ae_source = f"{root / AE_CONFIG_FILE}" if (root / AE_CONFIG_FILE).is_file() else "the built-in FLUX VAE config"

    def fail(source: str, detail: str) -> None:
        raise CheckpointError(
            f"{source} does not match the weights: {detail}; the config files do not belong to these weights "
            f"(re-download the checkpoint folder)"
        )

    def count(header, path, source, prefix, what: str, expected: int) -> None:
        found = _indices(header, prefix)
        if found != set(range(expected)):
            have = f"{len(found)} ({prefix}{min(found)} to {prefix}{max(found)})" if found else f"no {prefix}*"
            fail(source, f"{what}, but {path.name} holds {have}")

    def shape(header, path, source, name, expected, fields) -> None:
        if name not in header:
            fail(source, f"{path.name} lacks the tensor {name!r}")
        if tuple(header[name]) != tuple(expected):
            fail(source, f"{fields} give {name} the shape {tuple(expected)}, but {path.name} stores {tuple(header[name])}")

    llm_src = str(root / LLM_CONFIG_FILE) if llm_source is None else llm_source
    vit_src = str(root / VIT_CONFIG_FILE) if vit_source is None else vit_source
    lm = "language_model.model."
    count(ema, ema_path, llm_src, f"{lm}layers.", f"num_hidden_layers = {llm.num_hidden_layers} layers",
          llm.num_hidden_layers)
    shape(ema, ema_path, llm_src, f"{lm}embed_tokens.weight", (llm.vocab_size, llm.hidden_size),
          "vocab_size and hidden_size")
    shape(ema, ema_path, llm_src, f"{lm}layers.0.mlp.gate_proj.weight", (llm.intermediate_size, llm.hidden_size),
          "intermediate_size and hidden_size")
    shape(ema, ema_path, llm_src, f"{lm}layers.0.self_attn.q_proj.weight",
          (llm.num_attention_heads * llm.head_dim, llm.hidden_size), "num_attention_heads and hidden_size")
    shape(ema, ema_path, llm_src, f"{lm}layers.0.self_attn.k_proj.weight",
          (llm.num_key_value_heads * llm.head_dim, llm.hidden_size), "num_key_value_heads and hidden_size")
    vm = "vit_model.vision_model."
    # the file counts one more ViT layer than is built (BAGEL drops the last one)
    count(ema, ema_path, vit_src, f"{vm}encoder.layers.",
          f"num_hidden_layers = {vit.num_hidden_layers + 1} means {vit.num_hidden_layers} built layers (the last is "
          f"dropped)", vit.num_hidden_layers)
    shape(ema, ema_path, vit_src, f"{vm}embeddings.patch_embedding.weight",
          (vit.hidden_size, vit.num_channels * vit.patch_size**2), "hidden_size, num_channels and patch_size")
    shape(ema, ema_path, vit_src, f"{vm}embeddings.position_embedding.weight", (vit.num_positions, vit.hidden_size),
          "image_size, patch_size and hidden_size")
    shape(ema, ema_path, vit_src, f"{vm}encoder.layers.0.mlp.fc1.weight", (vit.intermediate_size, vit.hidden_size),
          "intermediate_size and hidden_size")
    if ae is None:
        return
    levels = len(aec.ch_mult)
    count(ae, ae_path, ae_source, "encoder.down.", f"ch_mult has {levels} levels", levels)
    count(ae, ae_path, ae_source, "decoder.up.", f"ch_mult has {levels} levels", levels)
    blocks = f"num_res_blocks = {aec.num_res_blocks} blocks per level"
    for level in range(levels):
        count(ae, ae_path, ae_source, f"encoder.down.{level}.block.", blocks, aec.num_res_blocks)
        count(ae, ae_path, ae_source, f"decoder.up.{level}.block.", f"{blocks} (+1 in the decoder)",
              aec.num_res_blocks + 1)
    shape(ae, ae_path, ae_source, "encoder.conv_in.weight", (aec.ch, aec.in_channels, 3, 3), "ch and in_channels")
    shape(ae, ae_path, ae_source, "encoder.conv_out.weight", (2 * aec.z_channels, aec.ch * aec.ch_mult[-1], 3, 3),
          "z_channels, ch and ch_mult")
    shape(ae, ae_path, ae_source, "decoder.conv_out.weight", (aec.out_ch, aec.ch * aec.ch_mult[0], 3, 3),
          "out_ch, ch and ch_mult")


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


def _build_and_read(
    config: BagelConfig,
    ema_path: Path,
    ae_path: Path | None,
    *,
    where: str,
    dtype: torch.dtype,
    device: torch.device,
    device_map: Any,
    folder: Path | None,
    max_memory: Mapping[Any, Any] | None,
) -> tuple[Bagel, AutoEncoder | None]:
    """Build on the meta device, check every name/shape, read each file once and assign in place."""
    try:
        with torch.device("meta"):
            model = Bagel(config)
            vae = AutoEncoder(config.ae) if ae_path is not None else None
    except (RuntimeError, ValueError, OverflowError) as exc:  # e.g. a width whose storage size overflows
        raise CheckpointError(
            f"cannot build the model described by the config files of {where}: {type(exc).__name__}: {exc}; "
            f"check the config JSON (re-download or re-convert the checkpoint)"
        ) from None
    load_device = torch.device("cpu") if device_map is not None else device
    _assign(model, _read_safetensors(ema_path, _expected_shapes(model), device=load_device, dtype=dtype))
    if vae is not None:
        _assign(vae, _read_safetensors(ae_path, _expected_shapes(vae), device=device, dtype=torch.float32))
        vae.eval()
    model.reset_buffers(load_device)
    model.eval()
    if device_map is not None:
        model = _dispatch(model, device_map, dtype, folder, max_memory)
    return model, vae


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
) -> LoadedBagel:
    """Load model, VAE, tokenizer and config from a BAGEL checkpoint folder or single ``.safetensors`` file.

    Args:
        checkpoint: either the official folder (``llm_config.json``, ``vit_config.json``,
            ``ema.safetensors``, ``ae.safetensors``, ``vocab.json``, ``merges.txt``,
            ``tokenizer_config.json``; ``ae_config.json`` optional), or one converted ``.safetensors``
            file (ComfyUI-BAGEL's single-file form, :mod:`.single_file`: the ``ema`` tensors with configs in
            its metadata or a sidecar; no VAE and no tokenizer inside).
        dtype: dtype of the BAGEL weights (bf16, fp16 or fp32); the VAE is always fp32.
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

    Only headers are read before the configs are validated against them; each weight file's data is
    read once.

    Raises:
        CheckpointError: missing/corrupt/mismatching files, pickle files instead of safetensors, a config
            that does not describe the weight files (checked on the headers before anything is built);
            for a single file also refused metadata (format version, variant, quantization, dtype), a
            sidecar of another file, no metadata and not BAGEL-7B-MoT's layout, a tokenizer whose
            special-token ids differ from the checkpoint's.
        NumericalError: a weight holds NaN/inf in the file, or overflows ``dtype`` (e.g. fp16).
        ValueError: unsupported ``dtype``, unavailable ``device``, bad ``device_map`` arguments; a single
            file without ``tokenizer_dir``, or ``tokenizer_dir``/``vae`` given with a folder.
    """
    root = Path(checkpoint)
    dtype = _parse_dtype(dtype)
    device = _parse_device(device)
    if max_memory is not None and device_map != "auto":
        raise ValueError(f"`max_memory` is only used with device_map='auto', got device_map={device_map!r}")
    if max_memory is not None and not isinstance(max_memory, Mapping):
        raise ValueError(f"`max_memory` must be a mapping device -> size such as {{'cpu': '8GiB'}}, got {max_memory!r}")
    folder = Path(offload_folder) if offload_folder is not None else None
    common = dict(dtype=dtype, device=device, device_map=device_map, folder=folder, max_memory=max_memory)
    if root.is_file():
        return _load_single_file(root, tokenizer_dir=tokenizer_dir, vae=vae, **common)
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
    config = load_bagel_config(root)
    tokenizer = BagelTokenizer.from_dir(root)
    if tokenizer.vocab_size > config.llm.vocab_size:
        raise CheckpointError(
            f"the tokenizer in {root} has {tokenizer.vocab_size} ids but llm_config.json says vocab_size="
            f"{config.llm.vocab_size}; the tokenizer files do not belong to this model"
        )
    # headers only: the config must describe these files before anything is built from it
    check_config_against_headers(config, root, read_header(root / EMA_FILE), read_header(root / AE_FILE))
    model, ae = _build_and_read(config, root / EMA_FILE, root / AE_FILE, where=str(root), **common)
    logger.info("loaded BAGEL from %s (%s on %s)", root, dtype, device)
    try:
        model_id = model_id_of(root)
    except (ValueError, TypeError):
        model_id = ""
    return LoadedBagel(
        model=model, vae=ae, tokenizer=tokenizer, config=config, checkpoint_dir=root, dtype=dtype, device=device,
        form="folder", model_id=model_id, tokenizer_dir=root,
    )


def _load_single_file(
    path: Path, *, tokenizer_dir: str | Path | None, vae: str | Path | None, **common: Any
) -> LoadedBagel:
    """:func:`load_bagel` of a single ``.safetensors`` file (see :mod:`.single_file`)."""
    from .single_file import check_single_file_name, check_tokenizer, inspect_single_file

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
    ae_path = None
    if vae is not None:
        ae_path = Path(vae)
        has_ae = AE_CONFIG_FILE in (info.metadata.get("model_configs") or {})
        check_config_against_headers(
            config, path.parent, info.shapes, read_header(ae_path), ema_path=path, ae_path=ae_path,
            ae_source=f"{path.name}[{info.source}]:{AE_CONFIG_FILE}" if has_ae else "the built-in FLUX VAE config",
        )
    model, ae = _build_and_read(config, path, ae_path, where=str(path), **common)
    logger.info("loaded BAGEL %s from the single file %s (%s on %s, VAE: %s)", info.variant, path, common["dtype"],
                common["device"], ae_path or "none")
    return LoadedBagel(
        model=model, vae=ae, tokenizer=tokenizer, config=config, checkpoint_dir=path, dtype=common["dtype"],
        device=common["device"], form="single_file", model_id=info.model_id, variant=info.variant,
        metadata=info.metadata, tokenizer_dir=tok_dir,
    )


__all__ = ["LoadedBagel", "load_bagel"]
