"""Token and memory accounting of a BAGEL request, from its shape alone (no forward runs).

* RoPE positions of a request's context (:func:`item_positions` for an item list, :func:`understanding_positions`,
  :func:`generation_positions` for one image and a prompt) and the refusal of a request longer than the model's
  positions (:func:`check_positions`, :func:`check_item_positions`: too many images names what would fit);
* the tokens each branch's cache holds (:func:`count_items`, :func:`count_request` → :class:`RequestTokens`), their
  KV bytes at the checkpoint's layer geometry (:func:`kv_bytes_per_token`, :meth:`RequestTokens.kv_bytes`);
* the device memory a request needs besides the weights (:func:`request_memory_bytes`; the VAE's working memory:
  :mod:`.vae`; TaylorSeer's factors while it is on: :func:`taylorseer_bytes`).

Token counts follow the blocks of :mod:`.contexts`: a text block is its tokens plus ``<|im_start|>`` and
``<|im_end|>``, an image block its tokens plus two boundary tokens; images take one RoPE position each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...kv.cache import Task
from ..config import BagelConfig
from ..contexts import GEN_THINK_SYSTEM_PROMPT, VLM_THINK_SYSTEM_PROMPT
from ..items import GenerateItem, ImageItem, Item, TextItem
from ..settings import UNDERSTANDING_DEFAULTS, GenerationSettings, UnderstandingSettings
from ..taylorseer import GENERATION_BRANCHES, factor_bytes
from ..transforms import ImageTransforms
from .vae import tiled_decode_bytes, vae_working_bytes

#: Tokens a block adds around its content (``<|im_start|>``/``<|im_end|>``, or an image's start/end).
BOUNDARY_TOKENS = 2
#: Prompt tokens a plan assumes (a long instruction; the prompt is small beside the image tokens).
PLAN_PROMPT_TOKENS = 64


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


def item_positions(
    tokenizer, items: Sequence[Item], *, generation: bool, think: bool, special_tokens: bool = False
) -> int:
    """RoPE positions of the largest context of an item list (:mod:`.items`): every text its tokens plus two, every
    image one per block (VAE and ViT for a generation, ViT for understanding; a :data:`~.items.GENERATE` marker's
    image as well, for the rounds after it), a generation's latent block one, and the think system prompt."""
    per_image = 2 if generation else 1
    used = 1 if generation else 0
    for item in items:
        if isinstance(item, TextItem):
            used += len(tokenizer.encode(item.text, special_tokens=special_tokens)) + BOUNDARY_TOKENS
        else:
            used += per_image
    if think:
        prompt = GEN_THINK_SYSTEM_PROMPT if generation else VLM_THINK_SYSTEM_PROMPT
        used += len(tokenizer.encode(prompt)) + BOUNDARY_TOKENS
    return used


def check_item_positions(
    config: BagelConfig,
    tokenizer,
    items: Sequence[Item],
    *,
    generation: bool,
    think: bool,
    special_tokens: bool = False,
    extra: int = 0,
    extra_name: str = "max_new_tokens",
    name: str = "items",
) -> None:
    """Refuse (before any forward) an item list needing more RoPE positions than the model has: a one-line
    ValueError naming the count of images, the limit and how many images would fit with these texts; ``extra``
    positions decoded after the context (``extra_name``: the setting to lower); ``name``: what the message calls
    the request (``prompt`` for a single-image call)."""
    used = item_positions(tokenizer, items, generation=generation, think=think, special_tokens=special_tokens)
    images = sum(isinstance(item, (ImageItem, GenerateItem)) for item in items)
    check_image_positions(config, used, images, generation=generation, extra=extra, extra_name=extra_name, name=name)


def check_image_positions(
    config: BagelConfig,
    used: int,
    images: int,
    *,
    generation: bool,
    extra: int = 0,
    extra_name: str = "max_new_tokens",
    name: str = "items",
) -> None:
    """:func:`check_item_positions` of a request whose context takes ``used`` RoPE positions with ``images``
    images in it (the run's item list, or the memory plan's ``--image-sizes``: one check for both)."""
    limit = config.llm.max_position_embeddings
    if used > limit and images > 1:
        per_image = 2 if generation else 1
        fit = max(0, (limit - (used - images * per_image)) // per_image)
        raise ValueError(
            f"`{name}` holds {images} images, more than the model's positions allow: the request needs {used} RoPE "
            f"positions ({per_image} per image) but max_position_embeddings = {limit}; at most {fit} images fit "
            f"with these texts: drop images or shorten the texts"
        )
    check_positions(config, used, 0, name)
    if extra:
        check_positions(config, used, extra, extra_name)


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
            f"max_position_embeddings = {limit}; shorten the {'texts' if name == 'items' else 'prompt'}"
            + (f" or lower `{name}`" if extra else "")
        )


# ----------------------------------------------------------------------------------------- tokens


@dataclass(frozen=True)
class RequestTokens:
    """The content tokens of one request's blocks (boundaries not included).

    Attributes:
        task: ``understanding``, ``t2i`` or ``edit``.
        prompt: text tokens (of every text item).
        system: think-mode system prompt tokens (0 without think mode).
        vit: ViT patch tokens of the input images (0 without one).
        vae: latent tokens of a generation's input images (0 otherwise).
        latent: latent tokens denoised (t2i and edit: ``(H/16) * (W/16)`` of the output).
        decoded: most tokens decoded: the answer (understanding) or the think plan (generation).
        images: ``(vae, vit)`` tokens of each input image in request order; empty: one image of ``vae``/``vit``
            tokens when either is set (the single-image requests).
        texts: text blocks (each adds its two boundary tokens).
        cfg_text_tail: tokens (boundaries included) at the end of ``gen`` that ``cfg_text`` does not hold: the last
            item when it is a text, 0 when it is an image; None: the one prompt after the images.
    """

    task: Task
    prompt: int
    system: int = 0
    vit: int = 0
    vae: int = 0
    latent: int = 0
    decoded: int = 0
    images: tuple[tuple[int, int], ...] = ()
    texts: int = 1
    cfg_text_tail: int | None = None

    def image_blocks(self) -> tuple[tuple[int, int], ...]:
        """``(vae, vit)`` tokens of every input image, in request order."""
        if self.images:
            return self.images
        return ((self.vae, self.vit),) if self.vae or self.vit else ()

    def branches(self) -> dict[str, int]:
        """Most tokens each branch's cache holds (uncompressed): ``{"gen"}`` for understanding; ``gen``,
        ``cfg_text``, ``cfg_img`` (and ``plan`` in think mode: a fork of ``gen`` the plan is decoded in)
        for generation. The plan is then appended to ``gen`` as a text block."""
        system = self.system + BOUNDARY_TOKENS if self.system else 0
        texts = self.prompt + BOUNDARY_TOKENS * self.texts
        if self.task == "understanding":
            vit = sum(v + BOUNDARY_TOKENS for _, v in self.image_blocks() if v)
            return {"gen": system + vit + texts + self.decoded}
        images = sum(vae + vit + 2 * BOUNDARY_TOKENS for vae, vit in self.image_blocks() if vae)
        tail = self.prompt + BOUNDARY_TOKENS if self.cfg_text_tail is None else self.cfg_text_tail
        gen = system + images + texts
        counts = {"gen": gen, "cfg_text": gen - tail, "cfg_img": system + texts}
        if self.system:
            counts["plan"] = counts["gen"] + self.decoded
            counts["gen"] += self.decoded + BOUNDARY_TOKENS
        return counts

    def largest_image(self) -> tuple[int, int]:
        """``(vae, vit)``: the most tokens of one input image's VAE block and of one ViT block (encoded and
        prefilled one image at a time)."""
        blocks = self.image_blocks()
        return max((vae for vae, _ in blocks), default=0), max((vit for _, vit in blocks), default=0)

    def largest_block(self) -> int:
        """Tokens of the largest single forward: a prefilled block or the latent query block."""
        blocks = [self.prompt, self.system, *self.largest_image(), self.latent]
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


def _generation(settings: GenerationSettings | UnderstandingSettings) -> GenerationSettings:
    """``settings`` of a text-to-image or edit request (the caller's task says so; a mismatch is a caller's bug)."""
    if not isinstance(settings, GenerationSettings):
        raise TypeError(f"a generation request takes GenerationSettings, got {type(settings).__name__}")
    return settings


def _understanding(settings: GenerationSettings | UnderstandingSettings) -> UnderstandingSettings:
    """``settings`` of an understanding request."""
    if not isinstance(settings, UnderstandingSettings):
        raise TypeError(f"an understanding request takes UnderstandingSettings, got {type(settings).__name__}")
    return settings


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
        system_prompt, decoded = VLM_THINK_SYSTEM_PROMPT, _understanding(settings).max_new_tokens
        vae = 0
    else:
        gen = _generation(settings)
        system_prompt, decoded = GEN_THINK_SYSTEM_PROMPT, gen.think_max_new_tokens if gen.think else 0
        step = config.latent_downsample
        latent = vae if task == "edit" else (gen.width // step) * (gen.height // step)
    system = len(tokenizer.encode(system_prompt)) if settings.think else 0
    prompt_tokens = len(tokenizer.encode(prompt, special_tokens=settings.prompt_special_tokens))
    return RequestTokens(
        task=task, prompt=prompt_tokens, system=system, vit=vit, vae=vae, latent=latent, decoded=decoded
    )


def count_items(
    config: BagelConfig,
    tokenizer,
    task: Task,
    items: Sequence[Item],
    settings: GenerationSettings | UnderstandingSettings,
) -> RequestTokens:
    """The :class:`RequestTokens` of an item list (:mod:`.items`) at its largest round: every image at its size
    (an image item with a given latent at the latent's size; a :data:`~.items.GENERATE` marker's image at the output
    size it is generated at), every text, the output (an edit's last image, or the text-to-image size)."""
    generation = task != "understanding"
    images: list[tuple[int, int]] = []
    prompt = texts = tail = 0
    output_size = (_generation(settings).width, _generation(settings).height) if task == "t2i" else None
    last_vae_size = None
    for item in items:
        if isinstance(item, TextItem):
            tokens = len(tokenizer.encode(item.text, special_tokens=settings.prompt_special_tokens))
            prompt, texts, tail = prompt + tokens, texts + 1, tokens + BOUNDARY_TOKENS
            continue
        tail = 0
        if isinstance(item, GenerateItem):  # its image is generated at the size of the one before it
            vae_size = last_vae_size if output_size is None else output_size
            if vae_size is None:  # request_items refuses a list whose first image is a GENERATE marker
                raise ValueError("a GENERATE marker needs an input image before it (or an output size)")
            vae, vit = image_tokens(config, vae_size, vae_size=vae_size)
        else:
            vae_size = _latent_size(config, item.latent) if generation else None
            vae, vit = image_tokens(config, item.image.size, vae_size=vae_size)
            if vae_size is None:
                vae_size = ImageTransforms.from_config(config).vae.resize.size_for(*item.image.size)
        last_vae_size = vae_size
        images.append((vae if generation else 0, vit))
    step = config.latent_downsample
    if task == "understanding":
        system_prompt, decoded, latent = VLM_THINK_SYSTEM_PROMPT, _understanding(settings).max_new_tokens, 0
    else:
        gen = _generation(settings)
        system_prompt, decoded = GEN_THINK_SYSTEM_PROMPT, gen.think_max_new_tokens if gen.think else 0
        width, height = output_size if output_size is not None else last_vae_size or (0, 0)
        latent = (width // step) * (height // step)
    return RequestTokens(
        task=task,
        prompt=prompt,
        system=len(tokenizer.encode(system_prompt)) if settings.think else 0,
        vit=sum(vit for _, vit in images),
        vae=sum(vae for vae, _ in images),
        latent=latent,
        decoded=decoded,
        images=tuple(images),
        texts=texts,
        cfg_text_tail=tail,
    )


def _latent_size(config: BagelConfig, latent) -> tuple[int, int] | None:
    """The pixel size a given source latent ``[1, C, H/8, W/8]`` sets (None without one)."""
    if latent is None:
        return None
    return latent.shape[3] * config.ae.downsample, latent.shape[2] * config.ae.downsample


def request_tokens(
    config: BagelConfig,
    task: Task,
    width: int,
    height: int,
    prompt_tokens: int = PLAN_PROMPT_TOKENS,
    answer_tokens: int | None = None,
    images: tuple[tuple[int, int], ...] | None = None,
) -> RequestTokens:
    """The tokens of a plan's request: its input ``images`` (``(width, height)`` each, in order, then a
    ``prompt_tokens`` prompt; None: one ``width x height`` input image for ``und``/``edit``, none for an ``und`` of
    size 0 or ``t2i``), default settings (no think mode); the output of an edit is its last image, of ``t2i``
    ``width x height``; an ``und`` answer of ``answer_tokens`` (default: the most the default settings decode)."""
    if images is None:
        images = ((width, height),) if width and height and task != "t2i" else ()
    blocks = tuple(image_tokens(config, size) for size in images)
    if task == "understanding":
        blocks = tuple((0, vit) for _, vit in blocks)
    step = config.latent_downsample
    latent = 0
    if task == "edit":
        latent = blocks[-1][0] if blocks else 0
    elif task == "t2i":
        latent = (width // step) * (height // step)
    return RequestTokens(
        task=task,
        prompt=prompt_tokens,
        vit=sum(vit for _, vit in blocks),
        vae=sum(vae for vae, _ in blocks),
        latent=latent,
        decoded=(UNDERSTANDING_DEFAULTS.max_new_tokens if answer_tokens is None else answer_tokens)
        if task == "understanding"
        else 0,
        images=blocks if len(blocks) > 1 else (),
    )


# ----------------------------------------------------------------------------------------- memory


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
    ``mlp``, plus TaylorSeer's factors with ``taylor_order``, :func:`~.taylorseer.taylorseer_order`) or the fp32 VAE
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
      on meta tensors under a :class:`~.trace.TensorMemoryTracker` (:func:`vae_working_bytes`);
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
    encode = vae_working_bytes(config, tokens.largest_image()[0], decode=False)
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


__all__ = [
    "BOUNDARY_TOKENS",
    "PLAN_PROMPT_TOKENS",
    "RequestTokens",
    "check_positions",
    "check_image_positions",
    "check_item_positions",
    "count_items",
    "count_request",
    "generation_positions",
    "image_tokens",
    "item_positions",
    "kv_bytes_per_token",
    "request_memory_bytes",
    "request_memory_parts",
    "request_tokens",
    "understanding_positions",
]
