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

The contexts of a request: :func:`build_understanding_context` (one ``gen`` context) and
:func:`build_generation_contexts` (``gen``, ``cfg_text``, ``cfg_img``, docs/bagel.md §5.3-§5.4), every
cache from the request's :class:`~unicache_core.kv.cache.CacheSession`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from PIL import Image
from torch import Tensor

from ..kv.cache import AttentionCall, CacheSession, KVCache, Phase
from ..kv.token_types import TokenType
from .checkpoint.loader import LoadedBagel
from .checkpoint.tensor_file import release_freed_host_memory
from .modeling import AutoEncoder
from .modeling.qwen2_mot import BranchInput
from .numerics import check_finite, check_noise
from .request import NO_GIVEN_LATENTS, GivenLatents
from .sampling import pack_latent
from .settings import source_latent_size
from .transforms import ImageTransforms, pil_img2rgb, to_tensor

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


def append_vit(loaded: LoadedBagel, ctx: Context, image: Tensor) -> int:
    """Prefill a ViT image block; ``image`` is ``[3, H, W]`` in ``[-1, 1]`` (ViT transform applied)."""
    device = loaded.device
    vit = loaded.model.embed_vit(image.to(device))  # [N, H]
    start, end = _boundary_embeds(loaded)
    embeds = torch.cat([start, vit.to(start.dtype), end])
    n = embeds.shape[0]
    positions = torch.full((n,), ctx.rope, dtype=torch.long, device=device)
    types = _types((TokenType.BOUNDARY, 1), (TokenType.SOURCE_VIT, n - 2), (TokenType.BOUNDARY, 1), device=device)
    call = AttentionCall(token_types=types, rope_positions=positions, causal=False, update=True, phase="prefill")
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


def append_vae(loaded: LoadedBagel, ctx: Context, latent: Tensor, h: int, w: int) -> int:
    """Prefill a clean VAE image block (t = 0, gen mode) from packed latents ``[h*w, 64]``."""
    device = loaded.device
    embeds = latent_block_embeds(loaded, latent, h, w, 0.0)
    n = embeds.shape[0]
    positions = torch.full((n,), ctx.rope, dtype=torch.long, device=device)
    types = _types((TokenType.BOUNDARY, 1), (TokenType.SOURCE_VAE, n - 2), (TokenType.BOUNDARY, 1), device=device)
    call = AttentionCall(token_types=types, rope_positions=positions, causal=False, update=True, phase="prefill")
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
    #: how the source latent of an edit was made (``"checkpoint_vae"``, ``"external_vae"``, ``"given"``).
    source_latent: str | None = None

    def branches(self) -> dict[str, Context]:
        return {"gen": self.gen, "cfg_text": self.cfg_text, "cfg_img": self.cfg_img}


def new_context(session: CacheSession, branch: str) -> Context:
    """An empty context whose cache comes from ``session``."""
    return Context(cache=session.new_cache(branch), rope=0)


def build_understanding_context(
    loaded: LoadedBagel,
    session: CacheSession,
    image: Image.Image | None,
    prompt: str,
    *,
    think: bool = False,
    special_tokens: bool = False,
) -> Context:
    """``[system (think)] [ViT image] [text]`` in one ``gen`` context (docs/bagel.md §4.6); ``special_tokens``:
    the prompt's control-token strings are parsed (:meth:`~.tokenizer.BagelTokenizer.encode`)."""
    ctx = new_context(session, "gen")
    if think:
        append_text(loaded, ctx, VLM_THINK_SYSTEM_PROMPT)
    if image is not None:
        transforms = ImageTransforms.from_config(loaded.config)
        resized = transforms.prepare(image, "image")
        append_vit(loaded, ctx, transforms.vit(resized))
    append_text(loaded, ctx, prompt, special_tokens=special_tokens)
    return ctx


def build_generation_contexts(
    loaded: LoadedBagel,
    session: CacheSession,
    prompt: str,
    *,
    image: Image.Image | None = None,
    size: tuple[int, int] | None = None,
    think: bool = False,
    generator: torch.Generator | None = None,
    given: GivenLatents = NO_GIVEN_LATENTS,
    vae=None,
    special_tokens: bool = False,
) -> GenerationContexts:
    """Build ``gen``, ``cfg_text`` and ``cfg_img`` as ``interleave_inference`` does (image, then text).

    Without ``image`` the output ``size`` is ``(width, height)``; for an edit it is the VAE-resized
    source size, or the size of ``given.source_latent`` when one is given (BAGEL's convention, any size on
    BAGEL's grid: :func:`given_latent_size`; the ViT then sees the image resized to it). Without a given
    latent the source latent comes from ``vae``'s encode (the chosen VAE: the checkpoint's
    :class:`~.modeling.AutoEncoder`, sampling with ``given.vae_noise`` or noise drawn from
    ``generator``, or an external :class:`~.latents.VAEAdapter`). ``special_tokens``: the prompt's control-token
    strings are parsed (:meth:`~.tokenizer.BagelTokenizer.encode`).
    """
    gen = new_context(session, "gen")
    cfg_img = new_context(session, "cfg_img")
    if think:
        append_text(loaded, gen, GEN_THINK_SYSTEM_PROMPT)
        append_text(loaded, cfg_img, GEN_THINK_SYSTEM_PROMPT)
    how = None
    if image is not None:
        transforms = ImageTransforms.from_config(loaded.config)
        resized = transforms.prepare(image, "image")
        vae_input = transforms.vae(resized)
        latent_size = given_latent_size(loaded, given.source_latent)
        if latent_size not in (None, resized.size):
            # the output follows the given latent; the ViT sees the image resized to the latent's pixel size
            resized = pil_img2rgb(image, "image").resize(latent_size, Image.BICUBIC)
            vae_input = to_tensor(resized)
        size = resized.size
        lp = loaded.config.latent_downsample
        h, w = vae_input.shape[1] // lp, vae_input.shape[2] // lp
        latent, how = source_latent(loaded, vae_input, vae=vae, given=given, generator=generator)
        release_between_phases(loaded)  # the encoder's activations, before the prefill's
        append_vae(loaded, gen, latent, h, w)
        append_vit(loaded, gen, transforms.vit(resized))
    # the official deepcopy(gen) point: after the image, before the text; the session builds it from gen
    cfg_text = Context(session.fork(gen.cache, "cfg_text"), gen.rope)
    append_text(loaded, gen, prompt, special_tokens=special_tokens)
    append_text(loaded, cfg_img, prompt, special_tokens=special_tokens)
    width, height = size
    return GenerationContexts(
        gen=gen, cfg_text=cfg_text, cfg_img=cfg_img, height=height, width=width, session=session, source_latent=how
    )


def release_between_phases(loaded: LoadedBagel) -> None:
    """On the CPU, give the memory the phase just finished has freed back to the system before the next one.

    The phases of a request (VAE encode, prefill, denoising, VAE decode) free activations of different sizes;
    glibc keeps much of that freed memory resident, and the next phase's tensors seldom fit in the holes, so the
    process's peak grows by what was kept (measured on the medium checkpoint's 512 px edit with freed memory given
    back after every phase: 408 MB peak RSS without, 368 MB with).
    """
    if loaded.device.type == "cpu":
        release_freed_host_memory()


def given_latent_size(loaded: LoadedBagel, z: object) -> tuple[int, int] | None:
    """Output ``(width, height)`` of an edit given the source latent ``z`` ``[1, C, H/8, W/8]`` (``None`` when
    ``z`` is None): its cells times ``ae.downsample``, checked against BAGEL's grid
    (:func:`~.settings.source_latent_size`)."""
    if z is None:
        return None
    channels = loaded.config.ae.z_channels
    if not isinstance(z, Tensor) or not z.is_floating_point() or z.ndim != 4 or tuple(z.shape[:2]) != (1, channels):
        if not isinstance(z, Tensor):
            got = type(z).__name__
        else:
            got = tuple(z.shape) if z.is_floating_point() else z.dtype
        raise ValueError(
            f"`source_latent` must be one floating-point latent [1, {channels}, H/8, W/8] in BAGEL's "
            f"convention, got {got}"
        )
    return source_latent_size(loaded.config, z.shape[2], z.shape[3])


def _check_latent_tensor(name: str, z: object, shape: tuple[int, ...], width: int, height: int) -> Tensor:
    """A caller's or external VAE's source latent: a float tensor of ``shape`` (finiteness checked after)."""
    if not isinstance(z, Tensor) or not z.is_floating_point():
        raise ValueError(
            f"`{name}` must be a floating-point torch.Tensor of shape {shape}, got "
            f"{type(z).__name__ if not isinstance(z, Tensor) else z.dtype}"
        )
    if tuple(z.shape) != shape:
        raise ValueError(
            f"`{name}` has shape {tuple(z.shape)}, but the source image is resized to {width}x{height} (BAGEL's VAE "
            f"transform), whose latent is {shape}; encode the image at {width}x{height} (e.g. resize it before "
            f"VAEEncode) or leave it None to encode here"
        )
    return z.detach().to("cpu", torch.float32)


def source_latent(
    loaded: LoadedBagel, vae_input: Tensor, *, vae, given: GivenLatents, generator: torch.Generator | None
) -> tuple[Tensor, str]:
    """Packed ``[(H/16)*(W/16), 64]`` clean latent of an edit's source ``[3, H, W]`` and how it was made.

    ``vae``: the VAE that encodes (ignored when ``given.source_latent`` is set).
    """
    cfg = loaded.config
    ds = cfg.ae.downsample
    height, width = vae_input.shape[1], vae_input.shape[2]
    shape = (1, cfg.ae.z_channels, height // ds, width // ds)
    chosen = None if given.source_latent is not None else vae
    if isinstance(chosen, AutoEncoder):
        if given.vae_noise is not None:
            check_noise("vae_noise", given.vae_noise, shape)
        latent = encode_vae_latent(loaded, vae_input, noise=given.vae_noise, generator=generator, vae=chosen)
        how = "checkpoint_vae" if chosen is loaded.vae else "external_vae"
        check_finite(
            latent,
            "the VAE encoding of the source image",
            "check ae.safetensors (re-download it); the VAE always runs in fp32",
        )
        return latent, how
    if given.vae_noise is not None:
        raise ValueError(
            "`vae_noise` is the sampling noise of the built-in VAE encode; it is not used with "
            "`source_latent` or an external VAE: leave it None"
        )
    if generator is not None:  # the draw the built-in encode makes, so the seed gives the same later noise
        torch.randn(shape, generator=generator, dtype=torch.float32)
    if given.source_latent is not None:
        z, how = _check_latent_tensor("source_latent", given.source_latent, shape, width, height), "given"
        advice = "pass a finite latent (e.g. from_comfy_latent of VAEEncode's samples)"
    else:
        with torch.inference_mode():
            z = chosen.encode(vae_input.unsqueeze(0).float().cpu())
        z, how = _check_latent_tensor("the external VAE's encode", z, shape, width, height), "external_vae"
        advice = "check the external VAE (its encode must return a finite [1, 16, H/8, W/8] latent)"
    check_finite(z, "the source latent" if how == "given" else "the external VAE encoding of the source image", advice)
    return pack_latent(z[0].float(), cfg.latent_patch_size), how
