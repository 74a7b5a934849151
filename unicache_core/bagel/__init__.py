"""BAGEL-7B-MoT inference engine with pluggable KV caches (framework-free, CPU or GPU).

Typical use::

    from unicache_core.bagel import BagelPipeline, load_bagel, preset

    pipe = BagelPipeline(load_bagel("models/BAGEL-7B-MoT"))          # full caches
    image = pipe.text_to_image("a red cube", preset("t2i", width=512, height=512), seed=42).image
    edited = pipe.edit("make it blue", image, seed=42).image          # the official edit settings
    answer = pipe.understand("What colour is the cube?", image).text
    both = pipe.generate("edit", [image, edited, "put the cube of the first image into the second"]).image

A request can be checked and its tokens counted once, then run (what the ComfyUI nodes do, sharing it with the
memory plan): ``request = pipe.check("edit", [image, "make it blue"])``, ``pipe.generate_request(request)``
(:class:`CheckedRequest`).

A compressing cache is plugged in with ``BagelPipeline(loaded, cache_factory=...)``. A single converted
``.safetensors`` (ComfyUI-BAGEL's form) loads with ``load_bagel(file, tokenizer_dir=..., vae=None or
"ae.safetensors")``; an external VAE goes in ``BagelPipeline(loaded, vae=adapter)``. Command line:
``python -m unicache_core.bagel {understand,t2i,edit} --checkpoint DIR --prompt TEXT``.

Importing this package loads no weights and has no side effects.
"""

from .checkpoint.loader import LoadedBagel, load_bagel
from .config import AEConfig, BagelConfig, LLMConfig, ResizeConfig, TransformConfig, ViTConfig, load_bagel_config
from .contexts import GEN_THINK_SYSTEM_PROMPT, VLM_THINK_SYSTEM_PROMPT, Context, GenerationContexts
from .items import GENERATE, ImageItem, TextItem
from .latents import VAEAdapter, from_comfy_latent, to_comfy_latent
from .pipeline import BagelPipeline, GenerationResult, UnderstandingResult
from .request import GivenLatents, RunHooks
from .request_check import CheckedRequest, check_request, check_single
from .run_info import GenerationInfo, UnderstandingInfo
from .sampling import RENORM_TYPES, combine_cfg, timestep_schedule
from .settings import GenerationSettings, UnderstandingSettings, preset
from .tokenizer import BagelTokenizer
from .transforms import (
    OFFICIAL_TRANSFORMS,
    VAE_TRANSFORM,
    VIT_TRANSFORM,
    ImageTransform,
    ImageTransforms,
    pil_img2rgb,
    prepare_input_image,
)
from .weights import HostOperations

__all__ = [
    "AEConfig",
    "BagelConfig",
    "BagelPipeline",
    "BagelTokenizer",
    "CheckedRequest",
    "Context",
    "GENERATE",
    "GEN_THINK_SYSTEM_PROMPT",
    "GenerationContexts",
    "GenerationInfo",
    "GenerationResult",
    "GenerationSettings",
    "GivenLatents",
    "HostOperations",
    "ImageItem",
    "ImageTransform",
    "ImageTransforms",
    "LLMConfig",
    "LoadedBagel",
    "OFFICIAL_TRANSFORMS",
    "RENORM_TYPES",
    "ResizeConfig",
    "RunHooks",
    "TextItem",
    "TransformConfig",
    "UnderstandingInfo",
    "UnderstandingResult",
    "UnderstandingSettings",
    "VAEAdapter",
    "VAE_TRANSFORM",
    "VIT_TRANSFORM",
    "VLM_THINK_SYSTEM_PROMPT",
    "ViTConfig",
    "check_request",
    "check_single",
    "combine_cfg",
    "from_comfy_latent",
    "load_bagel",
    "load_bagel_config",
    "pil_img2rgb",
    "prepare_input_image",
    "preset",
    "timestep_schedule",
    "to_comfy_latent",
]
