"""The one adapter of ComfyUI services: the V3 node API, model folders, progress, interrupts, model management,
devices.

This is the ONLY module of the pack that imports ComfyUI's modules. ComfyUI's V3 node API (``comfy_api.latest``:
``io`` and ``ComfyExtension``) is imported here at import, because the node classes derive from ``io.ComfyNode``;
``comfy``, ``folder_paths`` and the rest are imported lazily, inside functions. The unit tests run the nodes
without a host on a stand-in of ``comfy_api.latest`` (tests/comfy_stubs.py).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

from comfy_api.latest import ComfyExtension, io

logger = logging.getLogger(__name__)

#: ComfyUI model-folder names registered by the pack.
BAGEL_FOLDER = "bagel"
POLICY_FOLDER = "unicache_policies"
#: The pack's own model folder: it ships the trained default checkpoint (``make bundled`` adds the tiny test one).
PACK_ROOT = Path(__file__).resolve().parent.parent
PACK_BAGEL_DIR = PACK_ROOT / "models" / "bagel"
#: The policy tables shipped with the library.
SHIPPED_POLICY_DIR = PACK_ROOT / "unicache_core" / "compression" / "tables"


def _folder_paths():
    import folder_paths  # ComfyUI host module

    return folder_paths


def register_folders() -> None:
    """Register the ``bagel`` and ``unicache_policies`` model folders (idempotent; keeps user-added paths).

    ``bagel``: ComfyUI's ``models/bagel`` first, then the pack's own ``models/bagel``. ``unicache_policies``:
    ``models/unicache_policies``, then the shipped ``unicache_core/compression/tables`` (``.json`` files only).
    """
    fp = _folder_paths()
    fp.add_model_folder_path(BAGEL_FOLDER, os.path.join(fp.models_dir, BAGEL_FOLDER))
    fp.add_model_folder_path(BAGEL_FOLDER, str(PACK_BAGEL_DIR))
    fp.add_model_folder_path(POLICY_FOLDER, os.path.join(fp.models_dir, POLICY_FOLDER))
    fp.add_model_folder_path(POLICY_FOLDER, str(SHIPPED_POLICY_DIR))
    paths, exts = fp.folder_names_and_paths[POLICY_FOLDER]
    if not exts:
        fp.folder_names_and_paths[POLICY_FOLDER] = (paths, {".json"})


def bagel_folders() -> list[Path]:
    """The folders searched for BAGEL checkpoints, in priority order."""
    register_folders()
    return [Path(p) for p in _folder_paths().get_folder_paths(BAGEL_FOLDER)]


def policy_files() -> list[str]:
    """Names of the policy-table files in the ``unicache_policies`` folders."""
    register_folders()
    return sorted(_folder_paths().get_filename_list(POLICY_FOLDER))


def policy_path(name: str) -> Path:
    """Full path of a policy-table file listed by :func:`policy_files`. ComfyUI's ``get_full_path`` finds regular
    files only, so a listed FIFO, folder or dangling link is returned as it is, for the table reader to name what it
    is (never "not found")."""
    register_folders()
    path = _folder_paths().get_full_path(POLICY_FOLDER, name)
    if path is None and name in policy_files() and ".." not in Path(name).parts:
        listed = (Path(folder) / name for folder in _folder_paths().get_folder_paths(POLICY_FOLDER))
        path = next((str(candidate) for candidate in listed if os.path.lexists(candidate)), None)
    if path is None:
        folders = ", ".join(_folder_paths().get_folder_paths(POLICY_FOLDER))
        raise FileNotFoundError(
            f"policy table {name!r} not found in the unicache_policies folders ({folders}); "
            "pick another policy or put the JSON file there"
        )
    return Path(path)


def qwen_tokenizer_dir() -> Path:
    """ComfyUI's bundled Qwen2.5 tokenizer (used by single-file checkpoints, which carry no tokenizer)."""
    import comfy.utils

    return Path(comfy.utils.__file__).parent / "text_encoders" / "qwen25_tokenizer"


# ------------------------------------------------------------------------------------------- devices


def resolve_devices(choice: str):
    """``(load_device, offload_device)`` for the loader's ``device`` widget (``auto`` = ComfyUI's choice)."""
    import comfy.model_management as mm
    import torch

    if choice == "cpu":
        return torch.device("cpu"), torch.device("cpu")
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                "device 'cuda': CUDA is not available in this ComfyUI (torch.cuda.is_available() is "
                "False); choose device 'auto' or 'cpu'"
            )
        load = mm.get_torch_device()
        if getattr(load, "type", "") != "cuda":
            load = torch.device("cuda", torch.cuda.current_device())
        return load, mm.unet_offload_device()
    if choice != "auto":
        raise ValueError(f"`device` must be auto, cuda or cpu, got {choice!r}")
    return mm.get_torch_device(), mm.unet_offload_device()


def resolve_dtype(choice: str, device) -> str:
    """The loader's ``dtype`` widget → ``bf16``/``fp16``/``fp32`` (``auto``: bf16 where ComfyUI uses it, else fp32)."""
    if choice != "auto":
        return choice
    import comfy.model_management as mm

    if getattr(device, "type", "cpu") != "cpu" and mm.should_use_bf16(device):
        return "bf16"
    return "fp32"


# ------------------------------------------------------------------------------ weight dtypes

#: The loader's ``weight_dtype`` choices: core ``UNETLoader``'s.
WEIGHT_DTYPES = ("default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2")
#: Each choice as the library's ``weight_dtype`` name (``auto``: stored in the compute dtype).
_LIBRARY_WEIGHT_DTYPES = {
    "default": "auto",
    "fp8_e4m3fn": "fp8_e4m3fn",
    "fp8_e4m3fn_fast": "fp8_e4m3fn",
    "fp8_e5m2": "fp8_e5m2",
}


def host_operations(weight_dtype: str, compute_dtype: str, load_device):
    """ComfyUI's layer operations for the loader's ``weight_dtype``, picked as core ``UNETLoader`` has them picked.

    ``default`` stores the weights in the compute dtype (``comfy.ops.disable_weight_init``); the fp8 choices store
    Linear/Embedding/conv/norm weights in fp8 and cast them to ``compute_dtype`` per call (``manual_cast``), and
    ``fp8_e4m3fn_fast`` asks for fp8 matrix multiplication where the device has it (``fp8_ops``). Every family
    carries ``comfy_cast_weights``, so ComfyUI's lowvram loading may leave any layer on the offload device.

    Returns:
        the :class:`~unicache_core.bagel.HostOperations` to give :func:`unicache_core.bagel.load_bagel` as its
        ``weight_dtype``: the picked namespace and the library's name of the storage dtype.
    """
    import comfy.ops

    from unicache_core.bagel.checkpoint.loader import parse_dtype
    from unicache_core.bagel.weights import HostOperations, plain_storage_dtype

    if weight_dtype not in _LIBRARY_WEIGHT_DTYPES:
        raise ValueError(f"`weight_dtype` must be one of {', '.join(WEIGHT_DTYPES)}, got {weight_dtype!r}")
    name = _LIBRARY_WEIGHT_DTYPES[weight_dtype]
    compute = parse_dtype(compute_dtype)
    storage = plain_storage_dtype(name, compute)
    operations = comfy.ops.pick_operations(
        storage, compute, load_device=load_device, fp8_optimizations=weight_dtype == "fp8_e4m3fn_fast"
    )
    logger.info(
        "BAGEL weights %s (%s), computing in %s: ComfyUI operations %s",
        weight_dtype,
        storage,
        compute,
        getattr(operations, "__name__", operations),
    )
    return HostOperations(operations, name)


# ------------------------------------------------------------------------------ model management


@lru_cache(maxsize=1)
def _patcher_class():
    import comfy.model_patcher

    class BagelModelPatcher(comfy.model_patcher.ModelPatcher):
        """A ModelPatcher for BAGEL (model + VAE in one container, built from ComfyUI's operations): ComfyUI loads
        it whole or, short of memory, partially (lowvram: the layers left on the offload device bring their
        weights per call)."""

        def model_dtype(self):
            return getattr(self.model, "dtype", None)

    return BagelModelPatcher


def make_patcher(module, load_device, offload_device):
    """Wrap ``module`` (a :class:`nodes.model.BagelModules`) for ComfyUI's memory manager; its size is the bytes
    of the tensors as stored (fp8 weights count one byte each)."""
    from .model import module_bytes

    return _patcher_class()(module, load_device=load_device, offload_device=offload_device, size=module_bytes(module))


def load_to_device(patcher, memory_required: int) -> None:
    """Have ComfyUI load the model, keeping ``memory_required`` bytes (the request's KV cache and working memory,
    :mod:`unicache_core.bagel.memory.accounting`) free: all of it when it fits, else as much as fits (ComfyUI's lowvram
    partial load; the rest is cast to the load device layer by layer as it runs)."""
    import comfy.model_management as mm

    mm.load_models_gpu([patcher], memory_required=int(memory_required))


# ------------------------------------------------------------------------------ progress, interrupts


def progress_callback(total: int, node_id=None) -> Callable[..., None]:
    """A ``progress(done, total, latent=None)`` callback driving ComfyUI's progress bar.

    With ``latent`` (ComfyUI's FLUX convention ``[1, 16, H/8, W/8]``) it also sends a live preview, made by
    the previewer the user chose with ComfyUI's ``--preview-method`` (none by default; ``latent2rgb`` is a
    cheap linear projection, ``taesd`` needs ``models/vae_approx/taef1_decoder``).
    """
    import comfy.utils

    bar = comfy.utils.ProgressBar(max(1, int(total)), node_id=node_id)
    previewer = _previewer()

    def progress(done: int, total_now: int, latent=None) -> None:
        image = None
        if latent is not None and previewer is not None:
            image = previewer.decode_latent_to_preview_image("JPEG", latent.float().cpu())
        bar.update_absolute(int(done), int(total_now), image)

    return progress


def _previewer():
    """ComfyUI's latent previewer for FLUX latents, or None when previews are off (or unavailable)."""
    try:
        import comfy.latent_formats
        import latent_preview
    except ImportError:  # an older or stripped host: progress without previews
        return None
    return latent_preview.get_previewer("cpu", comfy.latent_formats.Flux())


def filter_prompt_errors(classes: set[str]) -> bool:
    """Have the host's ``/prompt`` answer give each refusal of the nodes ``classes`` once, tagged with its input
    (:func:`~.validation.one_error_per_input`): an aiohttp middleware on ComfyUI's server app, added while the pack
    loads (before the app starts). Returns whether it was added (False without a server, e.g. the unit tests' stand-in,
    or when the app already runs: ComfyUI's own answer then stands)."""
    try:
        import server
        from aiohttp import web
    except ImportError:
        return False
    instance = getattr(getattr(server, "PromptServer", None), "instance", None)
    app = getattr(instance, "app", None)
    if app is None or app.frozen:
        return False
    if any(getattr(added, "unicache_errors", False) for added in app.middlewares):
        return True  # the pack loaded once already
    from .validation import one_error_per_input

    @web.middleware
    async def one_error_each(request, handler):
        response = await handler(request)
        if request.method != "POST" or request.path not in ("/prompt", "/api/prompt") or response.status != 400:
            return response
        try:
            body = json.loads(response.body)
        except (TypeError, ValueError):  # not ComfyUI's JSON answer: left as it is
            return response
        return web.json_response(one_error_per_input(body, classes), status=400)

    one_error_each.unicache_errors = True
    app.middlewares.append(one_error_each)
    return True


def interrupted() -> bool:
    """True when the user pressed Cancel / ``POST /interrupt`` (non-raising: the engine then stops between steps)."""
    import comfy.model_management as mm

    return bool(mm.processing_interrupted())


def raise_interrupt() -> None:
    """Raise ComfyUI's interrupt exception (the prompt ends as ``execution_interrupted``, not as an error)."""
    import comfy.model_management as mm

    mm.throw_exception_if_processing_interrupted()
    raise mm.InterruptProcessingException()


__all__ = [
    "BAGEL_FOLDER",
    "ComfyExtension",
    "io",
    "PACK_BAGEL_DIR",
    "POLICY_FOLDER",
    "SHIPPED_POLICY_DIR",
    "WEIGHT_DTYPES",
    "bagel_folders",
    "filter_prompt_errors",
    "host_operations",
    "interrupted",
    "load_to_device",
    "make_patcher",
    "policy_files",
    "policy_path",
    "progress_callback",
    "qwen_tokenizer_dir",
    "raise_interrupt",
    "register_folders",
    "resolve_devices",
    "resolve_dtype",
]
