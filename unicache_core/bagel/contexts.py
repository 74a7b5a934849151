"""BAGEL contexts (one KV cache + its next RoPE position) and the blocks appended to them.

A :class:`Context` is the official ``{'kv_lens', 'ropes', 'past_key_values'}`` dict: a
:class:`~unicache_core.kv.cache.KVCache` plus the next RoPE position. Blocks (docs/bagel.md §4.2-§4.6):

=========  =====================================  =======  ==========  =====================================
block      tokens                                 mode     mask        positions / rope after
=========  =====================================  =======  ==========  =====================================
text       ``[im_start] text [im_end]``           und      causal      ``r .. r+n-1`` / ``r+n``
ViT image  ``[vs] vit tokens [ve]``               und      bidirect.   all ``r`` / ``r+1``
VAE image  ``[vs] clean latents (t=0) [ve]``      gen*     bidirect.   all ``r`` / ``r+1``
latents    ``[vs] noisy latents (t) [ve]``        gen*     bidirect.   all ``r`` / not cached
=========  =====================================  =======  ==========  =====================================

(*) boundary tokens use the und expert, latent tokens the gen expert (``gen_mask``).

An image block names the input image it belongs to (``index``: 0-based among the request's images, in request
order; :attr:`~unicache_core.kv.cache.AttentionCall.image`), so a cache can keep each image's rows apart. The
contexts of a request are built from its item list by :mod:`.interleave` (one ``gen`` context for understanding;
``gen``, ``cfg_text``, ``cfg_img`` for generation: :class:`GenerationContexts`), every cache from the request's
:class:`~unicache_core.kv.cache.CacheSession`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..kv.cache import AttentionCall, CacheSession, KVCache, Phase
from ..kv.scratch import release as release_scratch
from ..kv.token_types import TokenType
from .checkpoint.loader import LoadedBagel
from .checkpoint.tensor_file import release_freed_host_memory
from .modeling import AutoEncoder
from .modeling.qwen2_mot import BranchInput
from .sampling import pack_latent

#: System prompt prefilled before an understanding request in think mode (prompt text of inferencer.py).
VLM_THINK_SYSTEM_PROMPT = (
    "You should first think about the reasoning process in the mind and then provide the user with the answer. \n"
    "The reasoning process is enclosed within <think> </think> tags, i.e. <think> reasoning process here </think> "
    "answer here"
)
#: System prompt prefilled before a generation request in think mode (prompt text of inferencer.py).
GEN_THINK_SYSTEM_PROMPT = (
    "You should first think about the planning process in the mind and then generate the image. \n"
    "The planning process is enclosed within <think> </think> tags, i.e. <think> planning process here </think> "
    "image here"
)


@dataclass
class Context:
    """One BAGEL context: its cache and the RoPE position the next block starts at."""

    cache: KVCache
    rope: int = 0

    @property
    def num_tokens(self) -> int:
        return self.cache.num_tokens

    def clone(self, branch: str | None = None) -> Context:
        """Independent copy (the official ``deepcopy(gen_context)``)."""
        return Context(self.cache.clone(branch=branch), self.rope)


def _types(*parts: tuple[TokenType, int], device: torch.device) -> Tensor:
    return torch.cat([torch.full((n,), int(t), dtype=torch.int8, device=device) for t, n in parts])


def _boundary_embeds(loaded: LoadedBagel) -> tuple[Tensor, Tensor]:
    tok = loaded.tokenizer
    ids = torch.tensor([tok.start_of_image, tok.end_of_image], dtype=torch.long, device=loaded.device)
    emb = loaded.model.embed_text(ids)
    return emb[:1], emb[1:]


def text_ids(loaded: LoadedBagel, text: str, *, special_tokens: bool = False) -> list[int]:
    """``[im_start] + encode(text) + [im_end]`` (no chat template); ``special_tokens``: control-token strings in
    ``text`` become their ids (the official parsing), else the text is plain."""
    tok = loaded.tokenizer
    return [tok.bos_token_id, *tok.encode(text, special_tokens=special_tokens), tok.eos_token_id]


def append_text(loaded: LoadedBagel, ctx: Context, text: str, *, special_tokens: bool = False) -> int:
    """Prefill a text block into ``ctx`` (causal, und); returns the number of tokens appended."""
    ids = text_ids(loaded, text, special_tokens=special_tokens)
    n = len(ids)
    device = loaded.device
    embeds = loaded.model.embed_text(torch.tensor(ids, dtype=torch.long, device=device))
    positions = torch.arange(ctx.rope, ctx.rope + n, dtype=torch.long, device=device)
    types = _types((TokenType.BOUNDARY, 1), (TokenType.INSTRUCTION, n - 2), (TokenType.BOUNDARY, 1), device=device)
    call = AttentionCall(token_types=types, rope_positions=positions, causal=True, update=True, phase="prefill")
    loaded.model.forward_llm(embeds, positions, ctx.cache, call)
    ctx.rope += n
    return n


def append_vit(loaded: LoadedBagel, ctx: Context, image: Tensor, *, index: int | None = None) -> int:
    """Prefill a ViT image block; ``image`` is ``[3, H, W]`` in ``[-1, 1]`` (ViT transform applied); ``index``: the
    input image's 0-based place among the request's images (:attr:`~unicache_core.kv.cache.AttentionCall.image`)."""
    device = loaded.device
    vit = loaded.model.embed_vit(image.to(device))  # [N, H]
    start, end = _boundary_embeds(loaded)
    embeds = torch.cat([start, vit.to(start.dtype), end])
    n = embeds.shape[0]
    positions = torch.full((n,), ctx.rope, dtype=torch.long, device=device)
    types = _types((TokenType.BOUNDARY, 1), (TokenType.SOURCE_VIT, n - 2), (TokenType.BOUNDARY, 1), device=device)
    call = AttentionCall(
        token_types=types, rope_positions=positions, causal=False, update=True, phase="prefill", image=index
    )
    loaded.model.forward_llm(embeds, positions, ctx.cache, call)
    ctx.rope += 1
    return n


def encode_vae_latent(
    loaded: LoadedBagel,
    image: Tensor,
    *,
    noise: Tensor | None = None,
    generator: torch.Generator | None = None,
    vae=None,
) -> Tensor:
    """VAE-encode ``[3, H, W]`` (in ``[-1, 1]``, sides multiples of 16) → packed ``[(H/16)*(W/16), 64]`` fp32.

    The encoder samples ``mean + std * noise``; ``noise`` (``[1, 16, H/8, W/8]``) is drawn from
    ``generator`` on the CPU when not given (the official code draws it from the global CPU RNG).
    ``vae``: the :class:`~.modeling.AutoEncoder` to use (default ``loaded.vae``).
    """
    vae = loaded.vae if vae is None else vae
    x = image.unsqueeze(0).float()
    if noise is None:
        ds = loaded.config.ae.downsample
        shape = (1, loaded.config.ae.z_channels, x.shape[2] // ds, x.shape[3] // ds)
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
    device = vae_device(loaded, vae)
    z = vae.encode(x.to(device), noise=noise.to(device=device, dtype=torch.float32))
    return pack_latent(z[0].float(), loaded.config.latent_patch_size)


def vae_device(loaded: LoadedBagel, vae: AutoEncoder) -> torch.device:
    """Where ``vae`` runs: the checkpoint's own VAE runs where the model computes (``loaded.device``; a host may
    leave some of its layers on another device and bring their weights per call), another one where its first
    parameter is."""
    return loaded.device if vae is loaded.vae else next(vae.parameters()).device


def latent_block_embeds(loaded: LoadedBagel, x: Tensor, h: int, w: int, timestep: float) -> Tensor:
    """Embeddings ``[h*w + 2, H]`` of ``[vs] latents [ve]`` for packed latents ``x`` ``[h*w, 64]`` at time t."""
    device = loaded.device
    pos_ids = loaded.model.latent_position_ids(h, w).to(device)
    lat = loaded.model.embed_latents(x.to(device), pos_ids, timestep)
    start, end = _boundary_embeds(loaded)
    return torch.cat([start, lat.to(start.dtype), end])


def latent_gen_mask(num_latents: int, device: torch.device) -> Tensor:
    """``[num_latents + 2]`` bool mask: True for the latent tokens, False for the two boundaries."""
    mask = torch.ones(num_latents + 2, dtype=torch.bool, device=device)
    mask[0] = mask[-1] = False
    return mask


def append_vae(loaded: LoadedBagel, ctx: Context, latent: Tensor, h: int, w: int, *, index: int | None = None) -> int:
    """Prefill a clean VAE image block (t = 0, gen mode) from packed latents ``[h*w, 64]``; ``index``: the input
    image's 0-based place among the request's images (:attr:`~unicache_core.kv.cache.AttentionCall.image`)."""
    device = loaded.device
    embeds = latent_block_embeds(loaded, latent, h, w, 0.0)
    n = embeds.shape[0]
    positions = torch.full((n,), ctx.rope, dtype=torch.long, device=device)
    types = _types((TokenType.BOUNDARY, 1), (TokenType.SOURCE_VAE, n - 2), (TokenType.BOUNDARY, 1), device=device)
    call = AttentionCall(
        token_types=types, rope_positions=positions, causal=False, update=True, phase="prefill", image=index
    )
    loaded.model.forward_llm(embeds, positions, ctx.cache, call, gen_mask=latent_gen_mask(n - 2, device))
    ctx.rope += 1
    return n


def latent_velocities(
    loaded: LoadedBagel,
    contexts: dict[str, Context],
    embeds: Tensor,
    *,
    step: int,
    timestep: float,
    phase: Phase = "denoise",
    last_layer_hook: Callable[[str, Tensor], None] | None = None,
) -> dict[str, Tensor]:
    """One denoising forward of the latent query block over each context (not cached), the contexts together.

    The blocks run through the decoder layer by layer (:meth:`~.modeling.Bagel.forward_llm_branches`), so a
    low-precision or offloaded layer is upcast or copied once for all of them; each context's result equals
    its forward alone. Each cache sees its own ``begin_call``, ``attend`` per layer and ``end_call``, in that
    order (the caches' calls interleave by layer; a cache's stores are never modified in place by another's).

    Args:
        contexts: branch name → context, in the order the branches run.
        embeds: ``[N + 2, H]`` from :func:`latent_block_embeds` (shared by all contexts).
        last_layer_hook: ``hook(branch, hidden)`` with each branch's last decoder layer output ``[N + 2, H]``
            before the final norm (TaylorSeer keeps it, :mod:`.taylorseer`).

    Returns:
        branch name → ``[N, 64]`` velocity (``llm2vae`` of the latent positions).
    """
    device = loaded.device
    n = embeds.shape[0]
    types = _types((TokenType.BOUNDARY, 1), (TokenType.CURRENT_LATENT, n - 2), (TokenType.BOUNDARY, 1), device=device)
    mask = latent_gen_mask(n - 2, device)
    blocks = []
    for ctx in contexts.values():
        positions = torch.full((n,), ctx.rope, dtype=torch.long, device=device)
        call = AttentionCall(
            token_types=types,
            rope_positions=positions,
            causal=False,
            update=False,
            phase=phase,
            step=step,
            timestep=timestep,
        )
        blocks.append(BranchInput(embeds, positions, ctx.cache, call, mask))
    names = list(contexts)
    hook = None if last_layer_hook is None else (lambda index, h: last_layer_hook(names[index], h))
    hidden = loaded.model.forward_llm_branches(blocks, last_layer_hook=hook)
    return {name: loaded.model.latent_velocity(h[1:-1]) for name, h in zip(names, hidden)}


def decode_step(loaded: LoadedBagel, ctx: Context, token_id: int, step: int, token_type: TokenType) -> Tensor:
    """Feed one text token at position ``ctx.rope`` (causal, cached); returns its next-token logits ``[V]``."""
    device = loaded.device
    embeds = loaded.model.embed_text(torch.tensor([token_id], dtype=torch.long, device=device))
    positions = torch.tensor([ctx.rope], dtype=torch.long, device=device)
    types = torch.tensor([int(token_type)], dtype=torch.int8, device=device)
    call = AttentionCall(
        token_types=types, rope_positions=positions, causal=True, update=True, phase="decode", step=step
    )
    hidden = loaded.model.forward_llm(embeds, positions, ctx.cache, call)
    ctx.rope += 1
    return loaded.model.lm_logits(hidden)[0]


# ------------------------------------------------------------------------------------ request contexts


@dataclass
class GenerationContexts:
    """The three contexts of one generation request and the output size in pixels."""

    gen: Context
    cfg_text: Context
    cfg_img: Context
    height: int
    width: int
    session: CacheSession | None = None
    #: how the last input image's source latent was made (``"checkpoint_vae"``, ``"external_vae"``, ``"given"``;
    #: None without an input image)
    source_latent: str | None = None
    #: the same for every input image, in request order
    source_latents: tuple[str, ...] = ()

    def branches(self) -> dict[str, Context]:
        return {"gen": self.gen, "cfg_text": self.cfg_text, "cfg_img": self.cfg_img}


def new_context(session: CacheSession, branch: str) -> Context:
    """An empty context whose cache comes from ``session``."""
    return Context(cache=session.new_cache(branch), rope=0)


def release_between_phases(loaded: LoadedBagel) -> None:
    """On the CPU, give the memory the phase just finished has freed back to the system before the next one.

    The phases of a request (VAE encode, prefill, denoising, VAE decode) free activations of different sizes;
    glibc keeps much of that freed memory resident, and the next phase's tensors seldom fit in the holes, so the
    process's peak grows by what was kept (docs/engine.md, "Measurements behind the engine's choices"). The attention's
    scratch buffers (:mod:`unicache_core.kv.scratch`) of the phase are freed first.
    """
    release_scratch()
    if loaded.device.type == "cpu":
        release_freed_host_memory()
