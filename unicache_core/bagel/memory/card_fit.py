"""How many input images fit on a card: the memory plan (:mod:`.memory_plan`) searched over the image count.

:func:`most_images` answers one question ("how many 1024 px images can an fp8 edit take on a 12 GB card with
layer offload and UniCache?"); :func:`card_table` answers the README's table: for every card of
:data:`CARD_SIZES_GB`, fp8 weights with and without layer offload, full KV and UniCache at its default, the most
1024 px images of an edit (the edited image included) and the most 980 px images of an understanding question.

A card sold as ``N`` GB holds ``N`` GiB; the table plans for ``N x 10**9`` bytes (what ``plan --device-memory
NGB`` means), which leaves about 7% (0.6 GB of an 8 GB card, 1.8 GB of a 24 GB one) for what the plan does not count:
the CUDA context, the desktop and other processes. Every figure is a plan, checked against CPU tensor accounting at
BAGEL-7B-MoT's geometry (``benchmarks/real_size.py``) and on an H200 for one image (docs/results/gpu_real_size.json).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...kv.token_types import Task
from ..config import BagelConfig
from . import image_fit
from .plan import PlanSettings, official_config, plan_without_suggestion

#: Card memories of the README table, in GB.
CARD_SIZES_GB = (8, 12, 16, 24)
#: The table's image sizes: an edit's 1024 px images, an understanding question's 980 px images (the ViT's size).
TABLE_IMAGE_SIZES = {"edit": 1024, "und": 980}
#: The most images a search tries (far beyond what any card holds at these sizes).
MOST_IMAGES_SEARCHED = 1024


def most_images(
    config: BagelConfig,
    settings: PlanSettings,
    device_bytes: int,
    image_size: tuple[int, int],
    *,
    limit: int = MOST_IMAGES_SEARCHED,
) -> int:
    """The most input images of ``image_size`` that a request of ``settings`` (its task, dtypes, offload, KV
    method, device) fits in ``device_bytes`` by the plan (0 when not even one does; ``limit`` when that many do)."""

    def fits(count: int) -> bool:
        size = (int(image_size[0]), int(image_size[1]))
        trial = replace(settings, images=(size,) * count, width=size[0], height=size[1])
        return plan_without_suggestion(config, trial, device_bytes).fits

    if not fits(1):
        return 0
    low, high = 1, 2  # fits(low); the search doubles high until it does not fit
    while high <= limit and fits(high):
        low, high = high, high * 2
    high = min(high, limit + 1)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def fitting_images(config: BagelConfig, settings: PlanSettings, device_bytes: int) -> int:
    """The most of ``settings.images`` that fit in ``device_bytes`` by the plan, keeping the last ones (an edit edits
    its last image; the earlier ones are references): 0 when not even the last one fits."""
    return image_fit.fitting_images(settings, lambda trial: plan_without_suggestion(config, trial, device_bytes).fits)


@dataclass(frozen=True)
class CardRow:
    """One cell group of the card table: the most images of ``task`` at ``image_size`` px on a ``card_gb`` card."""

    card_gb: int
    task: str
    image_size: int
    weight_dtype: str
    offload: str
    kv_method: str
    most_images: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def card_table(
    config: BagelConfig | None = None,
    *,
    cards_gb: tuple[int, ...] = CARD_SIZES_GB,
    weight_dtype: str = "fp8_e4m3fn",
    kv_methods: tuple = ("full", "unicache"),
    offloads: tuple[str, ...] = ("none", "layers"),
) -> list[CardRow]:
    """The README's "what fits on your card" table for BAGEL-7B-MoT (``config``: another geometry): every card x
    offload x KV method x task (:data:`TABLE_IMAGE_SIZES`), planned on CUDA in bf16 compute."""
    config = official_config() if config is None else config
    rows = []
    for card in cards_gb:
        for offload in offloads:
            for kv_method in kv_methods:
                for task, side in TABLE_IMAGE_SIZES.items():
                    settings = PlanSettings(
                        task=task,
                        width=side,
                        height=side,
                        kv_method=kv_method,
                        weight_dtype=weight_dtype,
                        offload=offload,
                        device="cuda",
                    )
                    count = most_images(config, settings, card * 10**9, (side, side))
                    name = getattr(kv_method, "name", kv_method)  # a method name, or a configured method object
                    rows.append(CardRow(card, task, side, weight_dtype, offload, name, count))
    return rows


#: The ComfyUI figures: the cards and image counts of the streamed-bytes table, the box's requests (task, side).
COMFY_STREAM_CARDS_GB = (12, 16)
COMFY_STREAM_IMAGES = (2, 4)
COMFY_BOX_REQUESTS: tuple[tuple[Task, int], ...] = (("understanding", 1024), ("t2i", 1024), ("edit", 1024))


def comfy_request(
    config: BagelConfig,
    task: Task,
    side: int,
    images: int,
    kv_method: str,
    card_gb: int,
    weight_dtype: str = "fp8_e4m3fn",
) -> dict:
    """ComfyUI's placement (:func:`~.comfy_placement.comfy_placement`) of a request of ``images`` input images of
    ``side`` px (``t2i``: none, a ``side`` px output) on a ``card_gb`` card, with the ``memory_required`` the pack
    passes for it (:func:`~.comfy_placement.memory_required`), as a dict of bytes."""
    import torch

    from .accounting import request_tokens
    from .comfy_placement import comfy_placement, memory_required

    sizes = ((side, side),) * images if task != "t2i" and images else None
    tokens = request_tokens(config, task, side, side, images=sizes)
    required = memory_required(config, torch.bfloat16, tokens, kv_method)
    placement = comfy_placement(config, weight_dtype, torch.bfloat16, card_gb * 10**9, required, task=task)
    return {
        "card_gb": card_gb,
        "task": task,
        "side": side,
        "images": images,
        "kv_method": kv_method,
        "weight_dtype": weight_dtype,
        **placement.to_dict(),
    }


def comfy_stream_rows(config: BagelConfig | None = None) -> list[dict]:
    """The bytes ComfyUI streams per denoising step for a 1024² edit of :data:`COMFY_STREAM_IMAGES` images on
    :data:`COMFY_STREAM_CARDS_GB` cards (fp8), full KV and UniCache."""
    config = official_config() if config is None else config
    return [
        comfy_request(config, "edit", 1024, images, method, card)
        for card in COMFY_STREAM_CARDS_GB
        for images in COMFY_STREAM_IMAGES
        for method in ("full", "unicache")
    ]


def comfy_box_rows(config: BagelConfig | None = None, weight_dtypes=("fp8_e4m3fn", "default")) -> list[dict]:
    """ComfyUI's placement of each of :data:`COMFY_BOX_REQUESTS` (one input image) on every card of
    :data:`CARD_SIZES_GB`, per loader ``weight_dtype``, full KV and UniCache."""
    config = official_config() if config is None else config
    return [
        comfy_request(config, task, side, 0 if task == "t2i" else 1, method, card, weight_dtype)
        for card in CARD_SIZES_GB
        for weight_dtype in weight_dtypes
        for task, side in COMFY_BOX_REQUESTS
        for method in ("full", "unicache")
    ]


__all__ = [
    "CARD_SIZES_GB",
    "COMFY_BOX_REQUESTS",
    "COMFY_STREAM_CARDS_GB",
    "COMFY_STREAM_IMAGES",
    "CardRow",
    "comfy_box_rows",
    "comfy_request",
    "comfy_stream_rows",
    "MOST_IMAGES_SEARCHED",
    "TABLE_IMAGE_SIZES",
    "card_table",
    "fitting_images",
    "most_images",
]
