"""The runtime's own memory beside a request's tensors: the CPU's (oneDNN's kernel cache, the heap glibc keeps)
and CUDA's (cuBLAS workspaces, cuDNN's VAE workspaces). The memory plan (:mod:`.plan`) adds them on its
device; docs/memory.md gives the measurements every constant here was sized from.
"""

from __future__ import annotations

import torch

from ..config import BagelConfig
from .accounting import BOUNDARY_TOKENS, RequestTokens
from .vae import tiled_tokens

#: Bytes oneDNN keeps per bf16 matrix-product shape it has run (its compiled kernel; docs/memory.md).
CPU_MATMUL_KERNEL_BYTES = 600_000
#: Bytes oneDNN keeps per fp32 convolution shape it has run (docs/memory.md).
CPU_CONV_KERNEL_BYTES = 250_000
#: glibc's largest dynamic mmap threshold on 64-bit systems (``DEFAULT_MMAP_THRESHOLD_MAX``): blocks at least
#: this large are always mapped apart and given back when freed; smaller ones come from the heap, which keeps them.
GLIBC_MMAP_THRESHOLD_MAX = 32 << 20
#: Bytes CUDA allocates for a request beside its tensors (cuBLAS's and cuBLASLt's workspaces, taken from PyTorch's
#: caching allocator; measured on an H200, docs/memory.md).
CUDA_RUNTIME_BYTES = 88_000_000
#: Bytes per image pixel the fp32 VAE's decode takes on CUDA beyond its tensors (cuDNN's workspaces; H200).
CUDA_VAE_DECODE_PER_PIXEL = 274
#: The same for the encode of an edit's source (H200, one size measured).
CUDA_VAE_ENCODE_PER_PIXEL = 520


def cuda_runtime_parts(
    config: BagelConfig, tokens: RequestTokens, work: dict[str, int], *, tiled: bool = False
) -> dict[str, int]:
    """CUDA's own memory beside the tensors (:mod:`.plan`'s docstring): ``cuda_runtime``, and of the VAE pass
    that needs more on CUDA (the source's encode or the output's decode, whole or, when ``tiled``, one tile of it) its
    tensors (``vae_working``, from ``work`` = :func:`~.accounting.request_memory_parts`) and
    ``cuda_vae_workspace``."""
    pixels_per_token = config.latent_downsample**2
    decoded = tiled_tokens(config, tokens.latent) if tiled else tokens.latent
    encode = (work["vae_encode"], CUDA_VAE_ENCODE_PER_PIXEL * tokens.largest_image()[0] * pixels_per_token)
    decode = (
        work["vae_decode_tiled" if tiled else "vae_decode"],
        CUDA_VAE_DECODE_PER_PIXEL * decoded * pixels_per_token,
    )
    tensors, workspace = max(encode, decode, key=sum)
    return {"vae_working": tensors, "cuda_runtime": CUDA_RUNTIME_BYTES, "cuda_vae_workspace": workspace}


def matmul_shapes(config: BagelConfig, tokens: RequestTokens) -> set[tuple[int, int, int, bool]]:
    """The distinct ``(rows, in_features, out_features, bias)`` of the linear layers a request runs (oneDNN keeps
    one kernel for each).

    Each context block runs every decoder layer's projections at its own row count (the CFG branches one after
    the other, each block's und tokens and gen tokens apart); the ViT and the connector run at the ViT's token
    count, the latent heads and the timestep embedder at the latent count, ``lm_head`` at one row per answer
    token.
    """
    llm, vit = config.llm, config.vit
    hidden, q_out, kv_out = (
        llm.hidden_size,
        llm.num_attention_heads * llm.head_dim,
        llm.num_key_value_heads * llm.head_dim,
    )
    decoder = {
        (hidden, q_out, True),
        (hidden, kv_out, True),
        (q_out, hidden, False),
        (hidden, llm.intermediate_size, False),
        (llm.intermediate_size, hidden, False),
    }
    rows = {tokens.prompt + BOUNDARY_TOKENS}
    if tokens.system:
        rows.add(tokens.system + BOUNDARY_TOKENS)
    images = tokens.image_blocks()
    vits = {patches for _, patches in images if patches}
    gen_blocks = {latents for latents, _ in images if latents} | ({tokens.latent} if tokens.latent else set())
    rows.update(patches + BOUNDARY_TOKENS for patches in vits)
    for gen_tokens in gen_blocks:
        rows.update((gen_tokens, BOUNDARY_TOKENS))
    if tokens.decoded:
        rows.add(1)
    shapes = {(n, k, o, bias) for n in rows for k, o, bias in decoder}
    patch = 3 * vit.patch_size**2
    for vit_tokens in vits:
        shapes.update(
            (vit_tokens, k, o, True)
            for k, o in (
                (patch, vit.hidden_size),
                (vit.hidden_size, vit.hidden_size),
                (vit.hidden_size, vit.intermediate_size),
                (vit.intermediate_size, vit.hidden_size),
                (vit.hidden_size, hidden),
                (hidden, hidden),
            )
        )
    for gen_tokens in gen_blocks:
        shapes.add((gen_tokens, config.patch_latent_dim, hidden, True))
    if tokens.latent:
        shapes.update(
            (tokens.latent, k, o, True) for k, o in ((hidden, config.patch_latent_dim), (256, hidden), (hidden, hidden))
        )
    if tokens.decoded:
        shapes.add((1, hidden, llm.vocab_size, False))
    return shapes


def cpu_runtime_parts(config: BagelConfig, dtype: torch.dtype, tokens: RequestTokens) -> dict[str, int]:
    """The CPU runtime's own memory beside the tensors (:mod:`.plan`'s docstring): ``kernel_cache``,
    ``freed_heap`` and ``vae_heap``.

    ``kernel_cache`` = :data:`CPU_MATMUL_KERNEL_BYTES` x :func:`matmul_shapes` (bf16/fp16 compute: fp32 products
    go to MKL, which keeps none) + :data:`CPU_CONV_KERNEL_BYTES` x the VAE's distinct convolutions
    (:func:`~.vae.vae_convolution_shapes`). ``freed_heap``: the LLM forward's activations
    (:func:`~.accounting.request_memory_parts`) whose single tensors stay under :data:`GLIBC_MMAP_THRESHOLD_MAX`.
    ``vae_heap``: two of the VAE decode's largest activations under that threshold
    (:func:`~.vae.vae_activation_below`), and for an edit two of its encode's as well.

    Each term is sized from measurements listed in docs/memory.md ("Where the runtime terms come from").
    """
    from .vae import vae_activation_below, vae_convolution_shapes

    products = len(matmul_shapes(config, tokens)) if dtype != torch.float32 else 0
    encodes = {vae for vae, _ in tokens.image_blocks() if vae}
    convolutions = len(
        frozenset().union(*(vae_convolution_shapes(config, vae, decode=False) for vae in encodes))
        | vae_convolution_shapes(config, tokens.latent, decode=True)
    )
    llm = config.llm
    element = torch.empty((), dtype=dtype).element_size()
    queries = tokens.largest_block()
    branches = 1 if tokens.task == "understanding" else 3
    blocks = [
        (2, queries * llm.num_attention_heads * llm.head_dim * 4),
        (3, queries * llm.intermediate_size * element),
        (4 + branches, queries * llm.hidden_size * element),
    ]
    freed_heap = sum(count * size for count, size in blocks if size < GLIBC_MMAP_THRESHOLD_MAX)
    # the decode's own heap, plus what an edit's encode left resident under it (long-lived tensors made after the
    # encode, the source latent and the prefill's KV, sit between its freed blocks)
    vae_heap = 2 * (
        vae_activation_below(config, tokens.largest_image()[0], GLIBC_MMAP_THRESHOLD_MAX, decode=False)
        + vae_activation_below(config, tokens.latent, GLIBC_MMAP_THRESHOLD_MAX, decode=True)
    )
    return {
        "kernel_cache": products * CPU_MATMUL_KERNEL_BYTES + convolutions * CPU_CONV_KERNEL_BYTES,
        "freed_heap": int(freed_heap),
        "vae_heap": int(vae_heap),
    }


__all__ = [
    "CPU_CONV_KERNEL_BYTES",
    "CPU_MATMUL_KERNEL_BYTES",
    "CUDA_RUNTIME_BYTES",
    "CUDA_VAE_DECODE_PER_PIXEL",
    "CUDA_VAE_ENCODE_PER_PIXEL",
    "GLIBC_MMAP_THRESHOLD_MAX",
    "cpu_runtime_parts",
    "cuda_runtime_parts",
    "matmul_shapes",
]
