"""Token and memory accounting of a BAGEL request, from its shape alone (no forward runs).

* RoPE positions of a request's context (:func:`understanding_positions`, :func:`generation_positions`)
  and the refusal of a request longer than the model's positions (:func:`check_positions`);
* the tokens each branch's cache holds (:func:`count_request` → :class:`RequestTokens`), their KV bytes
  at the checkpoint's layer geometry (:func:`kv_bytes_per_token`, :meth:`RequestTokens.kv_bytes`);
* the device memory a request needs besides the weights (:func:`request_memory_bytes`), TaylorSeer's factors
  included when it is on (:func:`taylorseer_bytes`).

Token counts follow the blocks of :mod:`.contexts`: a text block is its tokens plus ``<|im_start|>`` and
``<|im_end|>``, an image block its tokens plus two boundary tokens; images take one RoPE position each.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ..kv.cache import Task
from .config import BagelConfig
from .contexts import GEN_THINK_SYSTEM_PROMPT, VLM_THINK_SYSTEM_PROMPT
from .settings import GenerationSettings, UnderstandingSettings
from .taylorseer import factor_bytes
from .transforms import ImageTransforms

#: Tokens a block adds around its content (``<|im_start|>``/``<|im_end|>``, or an image's start/end).
BOUNDARY_TOKENS = 2


# ----------------------------------------------------------------------------------------- positions


def understanding_positions(
    tokenizer, prompt: str, *, has_image: bool, think: bool, special_tokens: bool = False
) -> int:
    """RoPE positions of an understanding context: ``[system (think)] [ViT image] [prompt]``."""
    used = len(tokenizer.encode(prompt, special_tokens=special_tokens)) + 2 + (1 if has_image else 0)
    if think:
        used += len(tokenizer.encode(VLM_THINK_SYSTEM_PROMPT)) + 2
    return used


def generation_positions(tokenizer, prompt: str, *, has_image: bool, think: bool, special_tokens: bool = False) -> int:
    """RoPE positions of a ``gen`` context: ``[system] [VAE image, ViT image] prompt``, then the latent block."""
    used = len(tokenizer.encode(prompt, special_tokens=special_tokens)) + 2 + (2 if has_image else 0) + 1
    if think:
        used += len(tokenizer.encode(GEN_THINK_SYSTEM_PROMPT)) + 2
    return used


def check_positions(config: BagelConfig, used: int, extra: int, name: str) -> None:
    """Refuse (before any forward) a request needing more RoPE positions than the model was trained on.

    The official code would run past ``max_position_embeddings`` with untrained positions; here it
    is an error. Images take one position each, text one per token.
    """
    limit = config.llm.max_position_embeddings
    if used + extra > limit:
        detail = f"{used} for the context" + (f" + {extra} for decoding" if extra else "")
        raise ValueError(
            f"`{name}` is too long: the request needs {used + extra} RoPE positions ({detail}) but "
            f"max_position_embeddings = {limit}; shorten the prompt" + (f" or lower `{name}`" if extra else "")
        )


# ----------------------------------------------------------------------------------------- tokens


@dataclass(frozen=True)
class RequestTokens:
    """The content tokens of one request's blocks (boundaries not included).

    Attributes:
        task: ``understanding``, ``t2i`` or ``edit``.
        prompt: prompt text tokens.
        system: think-mode system prompt tokens (0 without think mode).
        vit: ViT patch tokens of the input image (0 without one).
        vae: latent tokens of an edit's source image (0 otherwise).
        latent: latent tokens denoised (t2i and edit: ``(H/16) * (W/16)`` of the output).
        decoded: most tokens decoded: the answer (understanding) or the think plan (generation).
    """

    task: Task
    prompt: int
    system: int = 0
    vit: int = 0
    vae: int = 0
    latent: int = 0
    decoded: int = 0

    def branches(self) -> dict[str, int]:
        """Most tokens each branch's cache holds (uncompressed): ``{"gen"}`` for understanding; ``gen``,
        ``cfg_text``, ``cfg_img`` (and ``plan`` in think mode: a fork of ``gen`` the plan is decoded in)
        for generation. The plan is then appended to ``gen`` as a text block."""
        system = self.system + BOUNDARY_TOKENS if self.system else 0
        prompt = self.prompt + BOUNDARY_TOKENS
        if self.task == "understanding":
            vit = self.vit + BOUNDARY_TOKENS if self.vit else 0
            return {"gen": system + vit + prompt + self.decoded}
        image = (self.vae + self.vit + 2 * BOUNDARY_TOKENS) if self.vae else 0
        counts = {"gen": system + image + prompt, "cfg_text": system + image, "cfg_img": system + prompt}
        if self.system:
            counts["plan"] = counts["gen"] + self.decoded
            counts["gen"] += self.decoded + BOUNDARY_TOKENS
        return counts

    def largest_block(self) -> int:
        """Tokens of the largest single forward: a prefilled block or the latent query block."""
        blocks = [self.prompt, self.system, self.vit, self.vae, self.latent]
        return max(blocks) + BOUNDARY_TOKENS

    def kv_bytes(self, config: BagelConfig, dtype: torch.dtype) -> dict[str, int]:
        """Uncompressed KV bytes of each branch (:meth:`branches` x :func:`kv_bytes_per_token`)."""
        per_token = kv_bytes_per_token(config, dtype)
        return {name: tokens * per_token for name, tokens in self.branches().items()}


def kv_bytes_per_token(config: BagelConfig, dtype: torch.dtype) -> int:
    """Bytes one cached token takes over all layers: keys and values of every KV head, in the model dtype."""
    llm = config.llm
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * llm.num_hidden_layers * llm.num_key_value_heads * llm.head_dim * element


def image_tokens(
    config: BagelConfig, source_size: tuple[int, int], *, vae_size: tuple[int, int] | None = None
) -> tuple[int, int]:
    """``(vae, vit)`` content tokens of an input image of ``(width, height)`` pixels after the checkpoint's resize
    rules (every input image is resized by the VAE rule first, then the ViT's); ``vae_size``: the size an edit's
    given source latent sets instead of the VAE rule."""
    transforms = ImageTransforms.from_config(config)
    width, height = vae_size if vae_size is not None else transforms.vae.resize.size_for(*source_size)
    vit_width, vit_height = transforms.vit.resize.size_for(width, height)
    step, patch = config.latent_downsample, config.vit.patch_size
    return (width // step) * (height // step), (vit_width // patch) * (vit_height // patch)


def count_request(
    config: BagelConfig,
    tokenizer,
    task: Task,
    prompt: str,
    settings: GenerationSettings | UnderstandingSettings,
    *,
    source_size: tuple[int, int] | None = None,
    vae_size: tuple[int, int] | None = None,
) -> RequestTokens:
    """The :class:`RequestTokens` of a request (``source_size``: the input image's ``(width, height)``;
    ``vae_size``: an edit's output size set by a given source latent, :func:`image_tokens`)."""
    vae = vit = latent = 0
    if source_size is not None:
        vae, vit = image_tokens(config, source_size, vae_size=vae_size)
    if task == "understanding":
        system_prompt, decoded = VLM_THINK_SYSTEM_PROMPT, settings.max_new_tokens
        vae = 0
    else:
        system_prompt, decoded = GEN_THINK_SYSTEM_PROMPT, settings.think_max_new_tokens if settings.think else 0
        step = config.latent_downsample
        latent = vae if task == "edit" else (settings.width // step) * (settings.height // step)
    system = len(tokenizer.encode(system_prompt)) if settings.think else 0
    prompt_tokens = len(tokenizer.encode(prompt, special_tokens=settings.prompt_special_tokens))
    return RequestTokens(
        task=task, prompt=prompt_tokens, system=system, vit=vit, vae=vae, latent=latent, decoded=decoded
    )


# ----------------------------------------------------------------------------------------- memory


#: The CFG branches a generation request may run per denoising step (``gen``, ``cfg_text``, ``cfg_img``).
GENERATION_BRANCHES = 3


def taylorseer_order(settings: GenerationSettings | UnderstandingSettings) -> int | None:
    """The Taylor order a request's TaylorSeer keeps (``settings.taylorseer_order``), or ``None`` without it."""
    return settings.taylorseer_order if getattr(settings, "taylorseer", False) else None


def taylorseer_bytes(config: BagelConfig, dtype: torch.dtype, tokens: RequestTokens, order: int | None) -> int:
    """Bytes TaylorSeer's factors hold at most (0 when ``order`` is ``None`` or the task is understanding): per CFG
    branch, ``order + 1`` tensors of the latent block ``[latent + 2, hidden]`` in the model dtype
    (:func:`~.taylorseer.factor_bytes`; this engine keeps them for the last decoder layer only, the official code
    for every layer: ``num_hidden_layers`` times as many)."""
    if order is None or tokens.task == "understanding" or not tokens.latent:
        return 0
    element = torch.empty((), dtype=dtype).element_size()
    return GENERATION_BRANCHES * factor_bytes(config.llm.hidden_size, tokens.latent, order, element)


def request_memory_bytes(
    config: BagelConfig, dtype: torch.dtype, tokens: RequestTokens, *, taylor_order: int | None = None
) -> int:
    """Estimate of the device memory one request needs besides the weights (:func:`request_memory_parts`).

    The larger of the two phases, which never run at the same time: the LLM's (the uncompressed KV of every
    branch, which compression starts from after the first step, plus its largest forward, ``attention`` +
    ``mlp``, plus TaylorSeer's factors with ``taylor_order``, :func:`taylorseer_order`) or the fp32 VAE
    encode/decode (``vae``: the source is encoded before anything is cached and the pipeline releases the caches
    and the factors before it decodes).
    """
    parts = request_memory_parts(config, dtype, tokens, taylor_order=taylor_order)
    return int(max(parts["kv"] + parts["attention"] + parts["mlp"] + parts["taylorseer"], parts["vae"]))


def request_memory_parts(
    config: BagelConfig, dtype: torch.dtype, tokens: RequestTokens, *, taylor_order: int | None = None
) -> dict[str, int]:
    """The parts of :func:`request_memory_bytes`: ``kv``, ``attention``, ``mlp``, ``taylorseer``
    (:func:`taylorseer_bytes` of ``taylor_order``) and ``vae`` bytes.

    For the largest block of ``T`` tokens (:meth:`RequestTokens.largest_block`) in the compute dtype of ``e``
    bytes, hidden size ``H``, MLP width ``I``, ``Hq`` query heads of dimension ``d``:

    * ``attention = T * 2 * Hq * d * 4``: the fp32 partial outputs of the cached and the new keys and their
      log-sum-exp merge. Scores are never materialised whole: on the CPU every block this estimate covers
      (image and latent blocks, decoding) goes through the flash kernel, which streams the keys in tiles; a
      text block after a cached context takes the chunked reference path, whose scores are bounded by
      :data:`~unicache_core.kv.attention.REFERENCE_SCORE_ELEMENTS` and are small beside a prompt's other
      memory; on a GPU the fused SDPA kernels hold no scores either.
    * ``mlp = T * (3 * I + (4 + B) * H) * e``: gate, up and their product alive together, four hidden-size
      tensors of the layer (residual, norm, attention output, projection) and the ``B`` blocks of a step's
      branches run together through each layer (1 for understanding, 3 for generation).
    * ``vae``: the peak of the fp32 VAE encoding the source or decoding the output, found by running the VAE
      on meta tensors under a :class:`~.memory_trace.TensorMemoryTracker` (:func:`vae_working_bytes`);
      ``vae_encode`` and ``vae_decode`` apart, and ``vae_decode_tiled``: the decode in tiles
      (:func:`tiled_decode_bytes`).

    Checked against a tensor-accounting run on CPU by ``benchmarks/memory_plan_check.py``.
    """
    llm = config.llm
    element = torch.empty((), dtype=dtype).element_size()
    kv = sum(tokens.kv_bytes(config, dtype).values())
    queries = tokens.largest_block()
    branches = 1 if tokens.task == "understanding" else GENERATION_BRANCHES
    attention = queries * 2 * llm.num_attention_heads * llm.head_dim * 4
    mlp = queries * (3 * llm.intermediate_size + (4 + branches) * llm.hidden_size) * element
    encode = vae_working_bytes(config, tokens.vae, decode=False)
    decode = vae_working_bytes(config, tokens.latent, decode=True)
    return {
        "kv": int(kv),
        "attention": int(attention),
        "mlp": int(mlp),
        "taylorseer": taylorseer_bytes(config, dtype, tokens, taylor_order),
        "vae": int(max(encode, decode)),
        "vae_encode": int(encode),
        "vae_decode": int(decode),
        "vae_decode_tiled": tiled_decode_bytes(config, tokens.latent),
    }


def tiled_tokens(config: BagelConfig, latent_tokens: int) -> int:
    """BAGEL latent tokens of one tile of :func:`~.modeling.vae_tiling.decode_tiled` (at most the image's)."""
    from .modeling.vae_tiling import TILE_CELLS

    side = TILE_CELLS * config.ae.downsample // config.latent_downsample
    return min(latent_tokens, side * side)


def tiled_decode_bytes(config: BagelConfig, latent_tokens: int) -> int:
    """Peak bytes of the tiled decode of ``latent_tokens`` BAGEL latent tokens: one tile's decode plus the fp32
    output and blend weights of the whole image (:func:`~.modeling.vae_tiling.tiled_decode_extra_bytes`)."""
    from .modeling.vae_tiling import tiled_decode_extra_bytes

    if latent_tokens <= 0:
        return 0
    pixels = latent_tokens * config.latent_downsample**2
    return vae_working_bytes(config, tiled_tokens(config, latent_tokens), decode=True) + tiled_decode_extra_bytes(
        pixels, 1
    )


def _latent_grid(latent_tokens: int, latent_downsample: int, vae_downsample: int) -> tuple[int, int]:
    """A ``(height, width)`` in VAE latent cells holding ``latent_tokens`` BAGEL latent tokens, as square as the
    count allows (a convolution's memory depends on the area only)."""
    rows = max(d for d in range(1, math.isqrt(latent_tokens) + 1) if latent_tokens % d == 0)
    cells = latent_downsample // vae_downsample
    return rows * cells, (latent_tokens // rows) * cells


@functools.lru_cache(maxsize=64)
def _vae_trace(config: BagelConfig, latent_tokens: int, decode: bool):
    """The VAE's decode (or encode) of ``latent_tokens`` (> 0) BAGEL latent tokens, run once on meta tensors
    (:func:`~.memory_trace.meta_trace`: nothing is allocated)."""
    from .memory_trace import meta_trace
    from .modeling import AutoEncoder

    ae = config.ae
    height, width = _latent_grid(latent_tokens, config.latent_downsample, ae.downsample)
    with torch.device("meta"):
        vae = AutoEncoder(ae)
    if decode:
        latent = torch.zeros(1, ae.z_channels, height, width, device="meta")
        return meta_trace(lambda: vae.decode(latent))
    image = torch.zeros(1, ae.in_channels, height * ae.downsample, width * ae.downsample, device="meta")
    return meta_trace(lambda: vae.encode(image, sample=False))


def vae_working_bytes(config: BagelConfig, latent_tokens: int, *, decode: bool) -> int:
    """Peak bytes of the fp32 tensors the VAE creates decoding (or encoding) an image of ``latent_tokens``
    BAGEL latent tokens (``16 x 16`` pixels each), measured on meta tensors (nothing is allocated)."""
    return _vae_trace(config, latent_tokens, decode).peak_bytes if latent_tokens > 0 else 0


def vae_activation_below(config: BagelConfig, latent_tokens: int, limit: int, *, decode: bool) -> int:
    """Bytes of the largest tensor under ``limit`` bytes that the VAE's decode (or encode) of ``latent_tokens``
    BAGEL latent tokens creates (recorded on meta tensors; 0 without any)."""
    if latent_tokens <= 0:
        return 0
    return max((size for size in _vae_trace(config, latent_tokens, decode).storage_sizes if size < limit), default=0)


def vae_convolution_shapes(config: BagelConfig, latent_tokens: int, *, decode: bool) -> frozenset:
    """The distinct convolutions (input shape, weight shape, stride, padding) of the VAE's decode (or encode) of
    ``latent_tokens`` BAGEL latent tokens, recorded on meta tensors."""
    return _vae_trace(config, latent_tokens, decode).convolutions if latent_tokens > 0 else frozenset()


__all__ = [
    "BOUNDARY_TOKENS",
    "RequestTokens",
    "check_positions",
    "count_request",
    "generation_positions",
    "image_tokens",
    "kv_bytes_per_token",
    "request_memory_bytes",
    "request_memory_parts",
    "taylorseer_bytes",
    "taylorseer_order",
    "tiled_decode_bytes",
    "tiled_tokens",
    "understanding_positions",
    "vae_activation_below",
    "vae_convolution_shapes",
    "vae_working_bytes",
]
