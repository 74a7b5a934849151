"""Training samples of the three tasks as BAGEL block sequences, and their packing into one batch.

A sample is a list of blocks in the order the pipeline builds its contexts (docs/bagel.md §4-5):

=============  ===================================================  =========================
task           blocks                                               loss
=============  ===================================================  =========================
understanding  ViT image, question text, answer text                answer tokens (CE)
text-to-image  caption text, noisy latents                          velocity (MSE)
edit           VAE source, ViT source, instruction, noisy latents   velocity (MSE)
=============  ===================================================  =========================

Classifier-free guidance needs the model to also work without the text (``cfg_text``) and, in
editing, without the source image (``cfg_img``); those blocks are dropped with small probabilities.
RoPE positions follow the inference rules: a text block takes one position per token, an image block
one position for all its tokens, and the noisy latents sit at the next position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from unicache_core.kv.token_types import TokenType

from .attention import SampleGroup


@dataclass
class Block:
    """One block: ``kind`` in ``text``, ``vit``, ``vae`` (clean source latents) or ``noisy``."""

    kind: str
    ids: list[int] | None = None  # text
    loss: bool = False  # text: predict its tokens
    pixels: Tensor | None = None  # vit: [3, H, W] in [-1, 1]
    latent: Tensor | None = None  # vae / noisy: [N, 64] packed latent (noisy: x_t)
    grid: tuple[int, int] = (0, 0)  # vae / noisy: latent token rows, cols
    timestep: float = 0.0  # noisy: flow time t
    target: Tensor | None = None  # noisy: [N, 64] velocity target (noise - x0)


@dataclass
class Sample:
    task: str
    blocks: list[Block] = field(default_factory=list)


def sample_length(sample: Sample, vit_patch: int) -> int:
    n = 0
    for b in sample.blocks:
        if b.kind == "text":
            n += len(b.ids)
        elif b.kind == "vit":
            n += (b.pixels.shape[1] // vit_patch) * (b.pixels.shape[2] // vit_patch) + 2
        else:
            n += b.latent.shape[0] + 2
    return n


@dataclass
class PackedBatch:
    """Everything one forward pass needs (``T`` = packed length over all groups).

    ``embeds`` is filled by the trainer from the pieces below (the model's embeddings are trained).
    """

    text_ids: Tensor  # [T] long, token id at text and boundary slots (0 elsewhere)
    text_slots: Tensor  # [T] bool, embedding comes from embed_tokens
    vit_pixels: list[Tensor]  # per ViT block [3, H, W]
    vit_slots: Tensor  # [n_vit] long, packed positions of the ViT tokens (in block order)
    latents: Tensor  # [n_lat, 64] packed latents (clean and noisy)
    latent_pos: Tensor  # [n_lat] latent position ids (row * max_latent_size + col)
    latent_t: Tensor  # [n_lat] flow time (0 for clean source latents)
    latent_slots: Tensor  # [n_lat] long, packed positions of the latent tokens
    positions: Tensor  # [T] RoPE positions
    gen_mask: Tensor  # [T] bool, gen expert
    token_types: Tensor  # [T] int8
    groups: list[SampleGroup]
    ce_slots: Tensor  # [n_ce] positions whose logits predict ...
    ce_targets: Tensor  # [n_ce] ... these ids
    mse_slots: Tensor  # [n_mse] positions of noisy latent tokens
    mse_targets: Tensor  # [n_mse, 64] their velocity targets
    tasks: list[str]


def pack(
    samples_by_task: dict[str, list[Sample]], *, start_id: int, end_id: int, vit_patch: int, max_latent_size: int
) -> PackedBatch:
    """Pack samples (grouped by task, each group padded to its longest sample) into one batch."""
    text_ids, text_slots, positions, gen_mask, types = [], [], [], [], []
    vit_pixels, vit_slots = [], []
    latents, latent_pos, latent_t, latent_slots = [], [], [], []
    ce_slots, ce_targets, mse_slots, mse_targets = [], [], [], []
    groups: list[SampleGroup] = []
    tasks: list[str] = []
    offset = 0
    for task, samples in samples_by_task.items():
        if not samples:
            continue
        length = max(sample_length(s, vit_patch) for s in samples)
        mask = torch.zeros(len(samples), length, length, dtype=torch.bool)
        for si, sample in enumerate(samples):
            tasks.append(task)
            base = offset + si * length
            cursor, rope = 0, 0
            spans: list[tuple[int, int, bool]] = []  # (start, end, causal) within the sample

            def put(token_id: int, pos: int, gen: bool, ttype: TokenType, is_text: bool, base: int = base) -> int:
                nonlocal cursor
                slot = base + cursor
                text_ids.append(token_id)
                text_slots.append(is_text)
                positions.append(pos)
                gen_mask.append(gen)
                types.append(int(ttype))
                cursor += 1
                return slot

            for block in sample.blocks:
                start = cursor
                if block.kind == "text":
                    n = len(block.ids)
                    for j, tid in enumerate(block.ids):
                        slot = put(
                            tid, rope + j, False, TokenType.BOUNDARY if j in (0, n - 1) else TokenType.INSTRUCTION, True
                        )
                        if block.loss and j < n - 1:
                            ce_slots.append(slot)
                            ce_targets.append(block.ids[j + 1])
                    rope += n
                    spans.append((start, cursor, True))
                    continue
                put(start_id, rope, False, TokenType.BOUNDARY, True)
                if block.kind == "vit":
                    rows, cols = block.pixels.shape[1] // vit_patch, block.pixels.shape[2] // vit_patch
                    vit_pixels.append(block.pixels)
                    for _ in range(rows * cols):
                        vit_slots.append(put(0, rope, False, TokenType.SOURCE_VIT, False))
                else:
                    rows, cols = block.grid
                    noisy = block.kind == "noisy"
                    latents.append(block.latent)
                    r = torch.arange(rows)[:, None] * max_latent_size + torch.arange(cols)[None, :]
                    latent_pos.append(r.reshape(-1))
                    latent_t.append(torch.full((rows * cols,), float(block.timestep)))
                    ttype = TokenType.CURRENT_LATENT if noisy else TokenType.SOURCE_VAE
                    for _ in range(rows * cols):
                        slot = put(0, rope, True, ttype, False)
                        latent_slots.append(slot)
                        if noisy:
                            mse_slots.append(slot)
                    if noisy:
                        mse_targets.append(block.target)
                put(end_id, rope, False, TokenType.BOUNDARY, True)
                if block.kind != "noisy":
                    rope += 1
                spans.append((start, cursor, False))
            # visibility: earlier blocks fully, own block causally (text) or fully (images)
            for start, end, causal in spans:
                if causal:
                    mask[si, start:end, start:end] = torch.tril(torch.ones(end - start, end - start, dtype=torch.bool))
                else:
                    mask[si, start:end, start:end] = True
                mask[si, start:end, :start] = True
            for _ in range(cursor, length):  # padding: sees only itself, seen by nobody
                mask[si, cursor, cursor] = True
                put(0, 0, False, TokenType.BOUNDARY, True)
        groups.append(SampleGroup(offset, len(samples), length, mask))
        offset += len(samples) * length
    return PackedBatch(
        text_ids=torch.tensor(text_ids, dtype=torch.long),
        text_slots=torch.tensor(text_slots, dtype=torch.bool),
        vit_pixels=vit_pixels,
        vit_slots=torch.tensor(vit_slots, dtype=torch.long),
        latents=torch.cat(latents) if latents else torch.zeros(0, 64),
        latent_pos=torch.cat(latent_pos) if latent_pos else torch.zeros(0, dtype=torch.long),
        latent_t=torch.cat(latent_t) if latent_t else torch.zeros(0),
        latent_slots=torch.tensor(latent_slots, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        gen_mask=torch.tensor(gen_mask, dtype=torch.bool),
        token_types=torch.tensor(types, dtype=torch.int8),
        groups=groups,
        ce_slots=torch.tensor(ce_slots, dtype=torch.long),
        ce_targets=torch.tensor(ce_targets, dtype=torch.long),
        mse_slots=torch.tensor(mse_slots, dtype=torch.long),
        mse_targets=torch.cat(mse_targets) if mse_targets else torch.zeros(0, 64),
        tasks=tasks,
    )
