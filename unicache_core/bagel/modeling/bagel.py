"""The BAGEL model: MoT language model + SigLIP ViT + connector + latent heads (inference only).

This module only embeds inputs and runs one packed block of new tokens through the LLM; building
contexts, positions and token types is the pipeline's job (docs/bagel.md §4–5). Submodule names equal the
top-level prefixes of ``ema.safetensors``. Every weight-bearing layer comes from the operations namespace
given at build time (:mod:`.operations`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ...kv.cache import AttentionCall, KVCache
from ..config import BagelConfig
from .embeddings import MLPconnector, PositionEmbedding, TimestepEmbedder
from .operations import LayerBuilder
from .qwen2_mot import BranchInput, Qwen2ForCausalLM
from .siglip import SiglipVisionModel


def patchify(image: Tensor, patch_size: int) -> Tensor:
    """``[C, H, W]`` → ``[(H/p)*(W/p), p*p*C]`` patches in raster order, features ``(row, col, channel)``."""
    c, h, w = image.shape
    p = patch_size
    if h % p or w % p:
        raise ValueError(f"image height/width ({h}, {w}) must be multiples of the patch size {p}")
    return image.reshape(c, h // p, p, w // p, p).permute(1, 3, 2, 4, 0).reshape(-1, p * p * c)


def grid_position_ids(rows: int, cols: int, max_per_side: int, device: torch.device | str | None = None) -> Tensor:
    """``[rows*cols]`` int64 ids ``row * max_per_side + col`` in raster order ("extrapolate" ids)."""
    if rows <= 0 or cols <= 0 or rows > max_per_side or cols > max_per_side:
        raise ValueError(f"grid ({rows}, {cols}) must be within 1..{max_per_side} per side")
    r = torch.arange(rows, device=device)
    c = torch.arange(cols, device=device)
    return (r[:, None] * max_per_side + c[None, :]).reshape(-1)


class Bagel(nn.Module):
    """BAGEL-7B-MoT (or a tiny model with the same structure).

    Submodules: ``language_model``, ``vit_model``, ``connector``, ``vit_pos_embed``,
    ``latent_pos_embed``, ``time_embedder``, ``vae2llm``, ``llm2vae``.

    Args:
        config: the model's configuration.
        operations: namespace of layer classes (``Linear``, ``Conv2d``, ``GroupNorm``, ``LayerNorm``,
            ``Embedding``); ``None`` = :class:`~.operations.TorchOperations`. ComfyUI's ``comfy.ops`` families
            and :func:`~.operations.low_precision_operations` fit.
        dtype: passed as ``dtype=`` to every layer of ``operations`` (with ComfyUI's, the weight storage dtype).
        device: where everything is allocated (``"meta"`` builds without memory).
        compute_dtype: dtype of the hidden states and of BAGEL's own tensors (RMSNorm weights, sin-cos
            tables); ``None`` = ``dtype``. Needed when ``dtype`` is a storage-only dtype (fp8).
        head_operations, head_dtype: the namespace and ``dtype=`` of the output head ``language_model.lm_head``
            alone (``None``: ``operations`` / ``dtype``). An 8-bit build keeps the head at 16 bits with them
            (:func:`~..weights.build_bagel`).
    """

    def __init__(
        self,
        config: BagelConfig,
        *,
        operations: Any = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        compute_dtype: torch.dtype | None = None,
        head_operations: Any = None,
        head_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        layers = LayerBuilder.create(operations, dtype, device, compute_dtype).with_head(head_operations, head_dtype)
        self.config = config
        hidden = config.llm.hidden_size
        self.language_model = Qwen2ForCausalLM(config.llm, layers)
        self.vit_model = SiglipVisionModel(config.vit, layers)
        self.connector = MLPconnector(config.vit.hidden_size, hidden, config.connector_act, layers)
        self.vit_pos_embed = PositionEmbedding(config.vit_max_num_patch_per_side, hidden, layers)
        self.time_embedder = TimestepEmbedder(hidden, layers=layers)
        self.vae2llm = layers.linear(config.patch_latent_dim, hidden)
        self.llm2vae = layers.linear(hidden, config.patch_latent_dim)
        self.latent_pos_embed = PositionEmbedding(config.max_latent_size, hidden, layers)
        #: Set after an accelerate dispatch (weights may then sit on 'meta' until their forward).
        self.execution_device: torch.device | None = None

    # ------------------------------------------------------------------ properties
    @property
    def num_layers(self) -> int:
        """Number of LLM decoder layers (= KV-cache layers)."""
        return self.config.llm.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.llm.hidden_size

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype of the hidden states (that of BAGEL's own norm weights, whatever the storage)."""
        return self.language_model.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        """Device inputs are sent to: :attr:`execution_device` when set (a dispatch's main device, or a host's
        load device), else where the final norm is."""
        if self.execution_device is not None:
            return self.execution_device
        return self.language_model.model.norm.weight.device

    def reset_buffers(self, device: torch.device | str | None = None) -> None:
        """Materialise non-persistent buffers (RoPE ``inv_freq``) on ``device`` (after a meta build)."""
        self.language_model.model.rotary_emb.reset_buffers(device if device is not None else self.device)

    # ------------------------------------------------------------------ embeddings
    def embed_text(self, ids: Tensor) -> Tensor:
        """``ids [n]`` int → ``[n, H]`` token embeddings."""
        if ids.dim() != 1:
            raise ValueError(f"`ids` must be a 1-D tensor of token ids, got shape {tuple(ids.shape)}")
        return self.language_model.model.embed_tokens(ids.to(self.device), out_dtype=self.dtype)

    def vit_position_ids(self, rows: int, cols: int) -> Tensor:
        """``[rows*cols]`` ids ``row * vit_max_num_patch_per_side + col``."""
        return grid_position_ids(rows, cols, self.config.vit_max_num_patch_per_side, self.device)

    def embed_vit(self, image: Tensor) -> Tensor:
        """ViT tokens of one image, at LLM width.

        Args:
            image: ``[3, Hi, Wi]`` in [-1, 1]; ``Hi``, ``Wi`` multiples of the ViT patch size.

        Returns:
            ``[N_vit, H]`` = connector(ViT(patches)) + ``vit_pos_embed[row*70+col]``,
            ``N_vit = (Hi/p)*(Wi/p)`` in raster order.
        """
        if image.dim() != 3 or image.shape[0] != self.config.vit.num_channels:
            raise ValueError(f"`image` must be [3, H, W], got shape {tuple(image.shape)}")
        p = self.config.vit.patch_size
        rows, cols = image.shape[1] // p, image.shape[2] // p
        patches = patchify(image.to(self.device, self.dtype), p)
        pos = self.vit_position_ids(rows, cols)
        feats = self.vit_model(patches, pos)
        out = self.connector(feats) + self.vit_pos_embed(pos)
        return out.to(self.dtype)

    def latent_position_ids(self, h_tokens: int, w_tokens: int) -> Tensor:
        """``[h*w]`` ids ``row * max_latent_size + col`` of a latent-token grid."""
        return grid_position_ids(h_tokens, w_tokens, self.config.max_latent_size, self.device)

    def embed_latents(self, x: Tensor, position_ids: Tensor, timestep: float) -> Tensor:
        """Latent tokens as LLM inputs.

        Args:
            x: ``[N, 64]`` packed latent tokens (features ``(pr, pc, c)``).
            position_ids: ``[N]`` latent position ids.
            timestep: flow time ``t`` in [0, 1] (0 = clean image); not scaled by 1000.

        Returns:
            ``[N, H]`` = ``vae2llm(x) + time_embedder(t) + latent_pos_embed[pos]``.
        """
        if x.dim() != 2 or x.shape[1] != self.config.patch_latent_dim:
            raise ValueError(f"`x` must be [N, {self.config.patch_latent_dim}], got shape {tuple(x.shape)}")
        if position_ids.shape != (x.shape[0],):
            raise ValueError(f"`position_ids` must have shape ({x.shape[0]},), got {tuple(position_ids.shape)}")
        t = torch.tensor([float(timestep)], device=self.device)
        emb = self.vae2llm(x.to(self.device, self.dtype))
        emb = emb + self.time_embedder(t, self.dtype) + self.latent_pos_embed(position_ids.to(self.device))
        return emb.to(self.dtype)

    # ------------------------------------------------------------------ LLM
    def forward_llm(
        self,
        embeds: Tensor,
        positions: Tensor,
        cache: KVCache,
        call: AttentionCall,
        gen_mask: Tensor | None = None,
    ) -> Tensor:
        """One packed block of NEW tokens through the MoT decoder.

        Args:
            embeds: ``[T, H]`` input embeddings.
            positions: ``[T]`` int RoPE positions.
            cache: the context's :class:`KVCache` (``begin_call`` / ``attend`` / ``end_call``).
            call: causal flag, update flag and metadata of this pass.
            gen_mask: ``[T]`` bool, True = the token uses the ``*_moe_gen`` expert; ``None`` = all und.

        Returns:
            ``[T, H]`` final-normed hidden states (``norm`` for und tokens, ``norm_moe_gen`` for gen).
        """
        return self.language_model.model(
            embeds.to(self.device, self.dtype), positions.to(self.device), cache, call, gen_mask
        )

    def forward_llm_branches(
        self, branches: Sequence[BranchInput], *, last_layer_hook: Callable[[int, Tensor], None] | None = None
    ) -> list[Tensor]:
        """Several blocks of new tokens, each over its own cache, through the decoder together.

        Each block's result equals :meth:`forward_llm` of that block alone; the layers run one at a time for
        all blocks, so a low-precision weight is upcast once per layer for all of them (e.g. the CFG branches
        of one denoising step). ``last_layer_hook(b, hidden)`` sees each block's last decoder layer output
        before the final norm. See :meth:`~.qwen2_mot.Qwen2Model.forward_branches`.

        Returns:
            ``[T_b, H]`` final-normed hidden states per block.
        """
        placed = [
            dataclasses.replace(b, embeds=b.embeds.to(self.device, self.dtype), positions=b.positions.to(self.device))
            for b in branches
        ]
        return self.language_model.model.forward_branches(placed, last_layer_hook=last_layer_hook)

    def final_norm(self, hidden: Tensor, gen_mask: Tensor | None = None) -> Tensor:
        """``[T, H]`` last-decoder-layer output → the final-normed hidden states :meth:`forward_llm` would return
        (``gen_mask`` as there)."""
        return self.language_model.model.final_norm(hidden.to(self.device), gen_mask)

    def lm_logits(self, hidden: Tensor) -> Tensor:
        """``[n, H]`` final-normed hidden → ``[n, V]`` logits."""
        return self.language_model.lm_head(hidden)

    def latent_velocity(self, hidden: Tensor) -> Tensor:
        """``[N, H]`` final-normed hidden of latent tokens → ``[N, 64]`` velocity (``llm2vae``)."""
        return self.llm2vae(hidden)


__all__ = ["Bagel", "grid_position_ids", "patchify"]
