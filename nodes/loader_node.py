"""``UniCacheBagelLoader``: a checkpoint of the ``bagel`` model folder → ``BAGEL_MODEL``."""

from __future__ import annotations

import logging

from unicache_core.bagel.checkpoint.official_layout import OFFICIAL_REPOSITORY, official_files_line
from unicache_core.bagel.settings import BUNDLED_CHECKPOINT

from . import host
from .base import CATEGORY, MODEL, UniCacheNode
from .host import io
from .model import (
    NO_CHECKPOINT,
    BagelModel,
    BagelModules,
    cached_model,
    demo_models_only,
    file_identity,
    list_checkpoints,
    load_checkpoint,
    remember_model,
    resolve_checkpoint,
    where_to_put,
)

logger = logging.getLogger(__name__)

DTYPES = ["auto", "bf16", "fp16", "fp32"]
DEVICES = ["auto", "cuda", "cpu"]


def checkpoint_choices() -> list[str]:
    try:
        names = list_checkpoints(host.bagel_folders())
    except ImportError:  # no host (unit tests without stubs): the pack's own folder only
        names = list_checkpoints([host.PACK_BAGEL_DIR])
    return names or [NO_CHECKPOINT]


class UniCacheBagelLoader(UniCacheNode):
    @classmethod
    def define_schema(cls):
        choices = checkpoint_choices()
        return io.Schema(
            node_id="UniCacheBagelLoader",
            display_name="UniCache BAGEL Loader",
            category=CATEGORY,
            description="Loads a BAGEL checkpoint from the `bagel` model folders (ComfyUI's models/bagel and the "
            "pack's models/bagel): an official BAGEL-7B-MoT folder or a single-file .safetensors checkpoint "
            "(tokenizer: ComfyUI's bundled Qwen2.5; VAE: connect a core VAELoader to the task nodes). The model is "
            "built from ComfyUI's layer operations, loaded once and reused by later prompts; ComfyUI moves it "
            "between the GPU and the offload device, partially when VRAM is short (lowvram), and `weight_dtype` "
            "stores its weights in fp8 as core UNETLoader does.",
            inputs=[
                io.Combo.Input(
                    "checkpoint",
                    options=choices,
                    default=BUNDLED_CHECKPOINT if BUNDLED_CHECKPOINT in choices else choices[0],
                    tooltip="A checkpoint in models/bagel: an official folder (holding llm_config.json) or a single "
                    ".safetensors file. The pack ships `unicache-shapes`, a small BAGEL trained on coloured shapes "
                    "(prompts like 'a large red circle at the top left on a white background'). For BAGEL-7B-MoT, "
                    f"put a folder in ComfyUI/models/bagel/ with {official_files_line()} from "
                    f"{OFFICIAL_REPOSITORY}, then press R.",
                ),
                io.Combo.Input(
                    "dtype",
                    options=DTYPES,
                    default="auto",
                    tooltip="Compute dtype of BAGEL, and the dtype of its weights with weight_dtype `default` (the "
                    "VAE always stays fp32). auto: bf16 on a GPU that supports it, else fp32. BAGEL-7B's weights "
                    "take about 29 GB in bf16/fp16 and 58 GB in fp32.",
                ),
                io.Combo.Input(
                    "device",
                    options=DEVICES,
                    default="auto",
                    tooltip="Where the model runs. auto: ComfyUI's device (GPU if any; honours --cpu); idle weights "
                    "go to ComfyUI's offload device.",
                ),
                # optional, so that a workflow saved before this input existed still runs (as `default`)
                io.Combo.Input(
                    "weight_dtype",
                    options=list(host.WEIGHT_DTYPES),
                    optional=True,
                    default="default",
                    tooltip="How BAGEL's weights are stored, as in core UNETLoader. default: in `dtype`. fp8_e4m3fn "
                    "/ fp8_e5m2: one byte per weight (about half of bf16), cast to `dtype` layer by layer as it "
                    "runs; images stay close to default's. fp8_e4m3fn_fast: also fp8 matrix multiplication on GPUs "
                    "that have it (RTX 40xx and newer). The VAE stays fp32.",
                ),
            ],
            outputs=[
                MODEL.Output(
                    "model",
                    display_name="model",
                    tooltip="The loaded BAGEL model (connect it to the UniCache task nodes).",
                )
            ],
        )

    @classmethod
    def fingerprint_inputs(cls, checkpoint, dtype, device, weight_dtype="default"):
        try:
            return repr((file_identity(resolve_checkpoint(checkpoint, host.bagel_folders())), weight_dtype))
        except (OSError, ValueError):
            return repr((checkpoint, weight_dtype))

    @classmethod
    def execute(cls, checkpoint, dtype, device, weight_dtype="default") -> io.NodeOutput:
        folders = host.bagel_folders()
        path = resolve_checkpoint(checkpoint, folders)
        if demo_models_only(list_checkpoints(folders)):
            logger.info(
                "running %s, a small model the pack ships (no BAGEL-7B-MoT in the bagel folders %s); for "
                "BAGEL-7B-MoT put %s from %s into %s and press R",
                checkpoint,
                ", ".join(str(f) for f in folders),
                official_files_line(),
                OFFICIAL_REPOSITORY,
                where_to_put(folders),
            )
        load_device, offload_device = host.resolve_devices(device)
        dtype_name = host.resolve_dtype(dtype, load_device)
        host_weights = host.host_operations(weight_dtype, dtype_name, load_device)
        identity = file_identity(path)
        key = (*identity, dtype_name, str(load_device), weight_dtype)
        model = cached_model(key)
        if model is None:
            loaded = load_checkpoint(
                path,
                dtype=dtype_name,
                device=offload_device,
                tokenizer_dir=host.qwen_tokenizer_dir,
                weight_dtype=host_weights,
            )
            patcher = host.make_patcher(BagelModules(loaded), load_device, offload_device)
            model = BagelModel(
                loaded=loaded,
                patcher=patcher,
                name=checkpoint,
                identity=identity,
                dtype=dtype_name,
                device=str(load_device),
                weight_dtype=weight_dtype,
            )
            remember_model(key, model)
        else:
            logger.info("reusing the loaded BAGEL checkpoint %s", checkpoint)
        return io.NodeOutput(model)
