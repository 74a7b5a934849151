"""BAGEL modules on the tiny checkpoint, checked against small explicit reference computations."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from unicache_core.bagel.checkpoint.loader import load_bagel
from unicache_core.bagel.config import AEConfig
from unicache_core.bagel.modeling import AutoEncoder, Bagel
from unicache_core.bagel.modeling.embeddings import PositionEmbedding
from unicache_core.bagel.modeling.operations import REQUIRED_LAYERS, TorchOperations
from unicache_core.bagel.modeling.qwen2_mot import Qwen2RMSNorm, Routing
from unicache_core.kv.cache import AttentionCall, FullKVCache
from unicache_core.kv.token_types import TokenType, type_tensor


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint: Path):
    return load_bagel(tiny_checkpoint, dtype=torch.float32)


@pytest.fixture(scope="module")
def model(loaded) -> Bagel:
    return loaded.model


def _call(n: int, positions: torch.Tensor, *, causal: bool, update: bool = True) -> AttentionCall:
    return AttentionCall(
        token_types=type_tensor(TokenType.INSTRUCTION, n), rope_positions=positions, causal=causal, update=update
    )


def _randomise_norms(model: Bagel, seed: int) -> Bagel:
    """Copy of ``model`` whose RMSNorm weights are not all ones (so norm/rotation order matters)."""
    m = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name and name.startswith("language_model"):
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=gen))
    return m


# ------------------------------------------------------------------------------------------ structure


def test_key_names_follow_the_official_layout(model: Bagel, loaded):
    """Names generated from the spec's key list (docs/bagel.md §1.2) equal the module's state dict."""
    cfg = loaded.config
    expected = {
        "language_model.model.embed_tokens.weight",
        "language_model.lm_head.weight",
        "language_model.model.norm.weight",
        "language_model.model.norm_moe_gen.weight",
        "vit_model.vision_model.embeddings.patch_embedding.weight",
        "vit_model.vision_model.embeddings.patch_embedding.bias",
        "vit_model.vision_model.embeddings.position_embedding.weight",
        "vit_model.vision_model.post_layernorm.weight",
        "vit_model.vision_model.post_layernorm.bias",
        "vit_pos_embed.pos_embed",
        "latent_pos_embed.pos_embed",
    }
    for head in ("connector.fc1", "connector.fc2", "time_embedder.mlp.0", "time_embedder.mlp.2", "vae2llm", "llm2vae"):
        expected |= {f"{head}.weight", f"{head}.bias"}
    for i in range(cfg.llm.num_hidden_layers):
        pre = f"language_model.model.layers.{i}."
        for sfx in ("", "_moe_gen"):
            expected |= {pre + f"input_layernorm{sfx}.weight", pre + f"post_attention_layernorm{sfx}.weight"}
            for proj in ("q", "k", "v"):
                expected |= {pre + f"self_attn.{proj}_proj{sfx}.weight", pre + f"self_attn.{proj}_proj{sfx}.bias"}
            expected |= {pre + f"self_attn.o_proj{sfx}.weight"}
            expected |= {pre + f"self_attn.q_norm{sfx}.weight", pre + f"self_attn.k_norm{sfx}.weight"}
            mlp = "mlp" if not sfx else "mlp_moe_gen"
            expected |= {pre + f"{mlp}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
    for j in range(cfg.vit.num_hidden_layers):
        pre = f"vit_model.vision_model.encoder.layers.{j}."
        for mod in (
            "layer_norm1",
            "layer_norm2",
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.out_proj",
            "mlp.fc1",
            "mlp.fc2",
        ):
            expected |= {pre + mod + ".weight", pre + mod + ".bias"}
    assert set(model.state_dict()) == expected
    sd = model.state_dict()
    h, d, p = cfg.llm.hidden_size, cfg.llm.head_dim, cfg.vit.patch_size
    assert sd["vit_model.vision_model.embeddings.patch_embedding.weight"].shape == (cfg.vit.hidden_size, 3 * p * p)
    assert sd["vit_pos_embed.pos_embed"].shape == (70 * 70, h)
    assert sd["latent_pos_embed.pos_embed"].shape == (64 * 64, h)
    assert sd["language_model.model.layers.0.self_attn.k_proj.weight"].shape == (cfg.llm.num_key_value_heads * d, h)
    assert sd["language_model.model.layers.0.self_attn.q_norm.weight"].shape == (d,)


def test_real_vae_key_names_on_meta():
    with torch.device("meta"):
        ae = AutoEncoder(AEConfig())
    sd = ae.state_dict()
    assert sd["encoder.conv_out.weight"].shape == (32, 512, 3, 3)
    assert sd["encoder.down.1.block.0.nin_shortcut.weight"].shape == (256, 128, 1, 1)
    assert "encoder.down.0.block.0.nin_shortcut.weight" not in sd
    assert "encoder.down.2.downsample.conv.weight" in sd and "encoder.down.3.downsample.conv.weight" not in sd
    assert "decoder.up.3.upsample.conv.weight" in sd and "decoder.up.0.upsample.conv.weight" not in sd
    assert sd["decoder.up.0.block.2.conv2.weight"].shape == (128, 128, 3, 3)
    assert sd["decoder.conv_in.weight"].shape == (512, 16, 3, 3)
    assert {f"encoder.mid.attn_1.{n}.weight" for n in ("norm", "q", "k", "v", "proj_out")} <= set(sd)


# ------------------------------------------------------------------------------------------ attention


def _reference_attention(layer, x: torch.Tensor, pos: torch.Tensor, theta: float, eps: float, causal: bool):
    """Explicit float64 QK-norm → RoPE (half split) → GQA attention → o_proj for one und layer."""
    att = layer.self_attn
    hq, hkv, d = att.num_heads, att.num_kv_heads, att.head_dim
    x = x.double()
    t = x.shape[0]

    def proj(lin, heads):
        return (x @ lin.weight.double().T + lin.bias.double()).view(t, heads, d)

    def rms(z, w):
        return z / torch.sqrt((z * z).mean(-1, keepdim=True) + eps) * w.double()

    def rope(z):
        out = z.clone()
        for i in range(d // 2):
            ang = pos.double() * theta ** (-(2.0 * i) / d)
            c, s = torch.cos(ang)[:, None], torch.sin(ang)[:, None]
            a, b = z[:, :, i], z[:, :, i + d // 2]
            out[:, :, i] = a * c - b * s
            out[:, :, i + d // 2] = b * c + a * s
        return out

    q = rope(rms(proj(att.q_proj, hq), att.q_norm.weight))
    k = rope(rms(proj(att.k_proj, hkv), att.k_norm.weight))
    v = proj(att.v_proj, hkv)
    out = torch.zeros(t, hq, d, dtype=torch.float64)
    for h in range(hq):
        kv = h // (hq // hkv)
        scores = q[:, h] @ k[:, kv].T / math.sqrt(d)
        if causal:
            scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        out[:, h] = torch.softmax(scores, -1) @ v[:, kv]
    return out.reshape(t, hq * d) @ att.o_proj.weight.double().T


@pytest.mark.parametrize("causal", [True, False])
def test_attention_matches_reference(model: Bagel, loaded, causal: bool):
    m = _randomise_norms(model, seed=1)
    cfg = loaded.config.llm
    layer = m.language_model.model.layers[0]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, cfg.hidden_size, generator=gen)
    pos = torch.tensor([0, 1, 2, 3, 3, 3, 9])  # repeated positions like an image block
    cos, sin = m.language_model.model.rotary_emb(pos, x.dtype)
    cache = FullKVCache(m.num_layers)
    got = layer.self_attn(x, cos, sin, Routing.from_mask(None, 7), cache, _call(7, pos, causal=causal))
    want = _reference_attention(layer, x, pos, cfg.rope_theta, cfg.rms_norm_eps, causal)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    # Keys are stored after QK-norm and RoPE.
    keys, _, _, stored_pos = cache.layer_kv(0)
    assert torch.equal(stored_pos, pos) and keys.shape == (7, cfg.num_key_value_heads, cfg.head_dim)


def _layer0_outputs(model: Bagel, embeds, pos, gen_mask):
    captured = {}
    handle = model.language_model.model.layers[0].register_forward_hook(
        lambda mod, args, out: captured.__setitem__("out", out)
    )
    try:
        final = model.forward_llm(
            embeds, pos, FullKVCache(model.num_layers), _call(len(pos), pos, causal=False), gen_mask
        )
    finally:
        handle.remove()
    return captured["out"], final


def test_mot_routing(model: Bagel, loaded):
    h = loaded.config.llm.hidden_size
    embeds = torch.randn(6, h, generator=torch.Generator().manual_seed(2))
    pos = torch.zeros(6, dtype=torch.long)
    gen_mask = torch.tensor([False, True, True, True, True, False])  # boundaries und, latents gen
    base, base_final = _layer0_outputs(model, embeds, pos, gen_mask)

    for param_name, changed in [
        ("self_attn.q_proj_moe_gen.weight", gen_mask),
        ("mlp_moe_gen.down_proj.weight", gen_mask),
        ("post_attention_layernorm_moe_gen.weight", gen_mask),
        ("self_attn.q_proj.weight", ~gen_mask),
        ("mlp.down_proj.weight", ~gen_mask),
    ]:
        m = copy.deepcopy(model)
        with torch.no_grad():
            m.language_model.model.layers[0].get_parameter(param_name).mul_(1.5).add_(0.05)
        out, _ = _layer0_outputs(m, embeds, pos, gen_mask)
        diff = (out - base).abs().amax(-1)
        assert (diff[changed] > 1e-4).all(), param_name
        assert (diff[~changed] == 0).all(), param_name

    # The final norm is per expert too.
    m = copy.deepcopy(model)
    with torch.no_grad():
        m.language_model.model.norm_moe_gen.weight.mul_(2.0)
    _, final = _layer0_outputs(m, embeds, pos, gen_mask)
    torch.testing.assert_close(final[gen_mask], 2.0 * base_final[gen_mask])
    assert torch.equal(final[~gen_mask], base_final[~gen_mask])

    # All-gen mask and no mask differ; an all-False mask equals no mask.
    _, all_gen = _layer0_outputs(model, embeds, pos, torch.ones(6, dtype=torch.bool))
    _, none = _layer0_outputs(model, embeds, pos, None)
    _, all_und = _layer0_outputs(model, embeds, pos, torch.zeros(6, dtype=torch.bool))
    assert not torch.allclose(all_gen, none)
    assert torch.equal(all_und, none)


def test_cached_prefill_equals_one_causal_pass(model: Bagel, loaded):
    tok = loaded.tokenizer
    ids = torch.tensor([tok.bos_token_id] + tok.encode("a red cat on a mat") + [tok.eos_token_id])
    n_a = 4
    pos = torch.arange(len(ids))
    embeds = model.embed_text(ids)

    full = model.forward_llm(embeds, pos, FullKVCache(model.num_layers), _call(len(ids), pos, causal=True))

    cache = FullKVCache(model.num_layers)
    out_a = model.forward_llm(embeds[:n_a], pos[:n_a], cache, _call(n_a, pos[:n_a], causal=True))
    out_b = model.forward_llm(embeds[n_a:], pos[n_a:], cache, _call(len(ids) - n_a, pos[n_a:], causal=True))
    torch.testing.assert_close(torch.cat([out_a, out_b]), full, rtol=1e-5, atol=1e-5)
    assert cache.num_tokens == len(ids)

    # A denoising-style block (update=False, bidirectional, gen tokens) never changes the cache.
    lat = model.embed_latents(
        torch.randn(4, 64, generator=torch.Generator().manual_seed(3)), model.latent_position_ids(2, 2), 0.7
    )
    block = torch.cat(
        [model.embed_text(torch.tensor([tok.start_of_image])), lat, model.embed_text(torch.tensor([tok.end_of_image]))]
    )
    bpos = torch.full((6,), len(ids))
    gmask = torch.tensor([False, True, True, True, True, False])
    first = model.forward_llm(block, bpos, cache, _call(6, bpos, causal=False, update=False), gmask)
    second = model.forward_llm(block, bpos, cache, _call(6, bpos, causal=False, update=False), gmask)
    assert cache.num_tokens == len(ids)
    assert torch.equal(first, second)
    # The latent tokens see the context: an empty cache gives different outputs.
    alone = model.forward_llm(block, bpos, FullKVCache(model.num_layers), _call(6, bpos, causal=False), gmask)
    assert not torch.allclose(alone, first)
    velocity = model.latent_velocity(first[1:5])
    assert velocity.shape == (4, 64) and torch.isfinite(velocity).all()


def test_forward_llm_uses_the_cache_seam(model: Bagel):
    events = []

    class Recording(FullKVCache):
        def begin_call(self, call):
            events.append("begin")

        def attend(self, layer, q, k, v, call):
            events.append(("attend", layer, tuple(q.shape), tuple(k.shape)))
            return super().attend(layer, q, k, v, call)

        def end_call(self, call):
            events.append("end")

    cfg = model.config.llm
    pos = torch.arange(3)
    model.forward_llm(
        model.embed_text(torch.tensor([1, 2, 3])), pos, Recording(model.num_layers), _call(3, pos, causal=True)
    )
    q_shape, k_shape = (3, cfg.num_attention_heads, cfg.head_dim), (3, cfg.num_key_value_heads, cfg.head_dim)
    assert events == ["begin"] + [("attend", i, q_shape, k_shape) for i in range(model.num_layers)] + ["end"]


def test_bf16_forward_is_finite_and_close(tiny_checkpoint: Path, model: Bagel):
    m16 = load_bagel(tiny_checkpoint, dtype=torch.bfloat16).model
    ids = torch.arange(3, 15)
    pos = torch.arange(12)
    out16 = m16.forward_llm(m16.embed_text(ids), pos, FullKVCache(m16.num_layers), _call(12, pos, causal=True))
    out32 = model.forward_llm(model.embed_text(ids), pos, FullKVCache(model.num_layers), _call(12, pos, causal=True))
    assert out16.dtype == torch.bfloat16 and torch.isfinite(out16).all()
    assert (out16.float() - out32).abs().max() < 0.1 * out32.abs().max()
    logits = m16.lm_logits(out16)
    assert logits.shape == (12, m16.config.llm.vocab_size)


# ------------------------------------------------------------------------------------------ embeddings


def test_sincos_tables_follow_the_official_layout(model: Bagel):
    for module, grid in ((model.vit_pos_embed, 70), (model.latent_pos_embed, 64)):
        table = module.pos_embed
        h = table.shape[1]
        quarter = h // 4
        for row, col in [(0, 0), (3, 5), (grid - 1, 1)]:
            k = row * grid + col
            want = []
            for coord in (col, row):  # official meshgrid: column coordinate in the first half
                omega = [1.0 / 10000 ** (j / quarter) for j in range(quarter)]
                want += [math.sin(coord * w) for w in omega] + [math.cos(coord * w) for w in omega]
            torch.testing.assert_close(table[k], torch.tensor(want, dtype=torch.float32), rtol=0, atol=1e-6)


def test_timestep_embedding_cos_first(model: Bagel):
    t = 0.3
    freq = model.time_embedder.frequency_embedding(torch.tensor([t]), 256)[0]
    f = torch.tensor([math.exp(-math.log(10000) * j / 128) for j in range(128)])
    torch.testing.assert_close(freq, torch.cat([torch.cos(t * f), torch.sin(t * f)]), rtol=1e-6, atol=1e-6)


def test_embed_vit_patch_order_and_positions(model: Bagel, loaded):
    p = loaded.config.vit.patch_size
    rows, cols = 2, 3
    image = torch.rand(3, rows * p, cols * p, generator=torch.Generator().manual_seed(5)) * 2 - 1
    patches, ids = [], []
    for r in range(rows):
        for c in range(cols):
            patches.append(image[:, r * p : (r + 1) * p, c * p : (c + 1) * p].permute(1, 2, 0).reshape(-1))
            ids.append(r * 70 + c)
    patches, ids = torch.stack(patches), torch.tensor(ids)
    feats = model.vit_model(patches, ids)
    want = model.connector(feats) + model.vit_pos_embed.pos_embed[ids]
    got = model.embed_vit(image)
    torch.testing.assert_close(got, want)
    # Bidirectional attention inside the image: changing the last patch changes the first token.
    image2 = image.clone()
    image2[:, -p:, -p:] = -image2[:, -p:, -p:]
    assert not torch.allclose(model.embed_vit(image2)[0], got[0])


def test_vit_layer_matches_reference(model: Bagel):
    layer = model.vit_model.vision_model.encoder.layers[0]
    x = torch.randn(5, layer.layer_norm1.weight.shape[0], generator=torch.Generator().manual_seed(6))
    att = layer.self_attn
    h = torch.nn.functional.layer_norm(x, x.shape[-1:], layer.layer_norm1.weight, layer.layer_norm1.bias, 1e-6)
    q, k, v = (lin(h).view(5, att.num_heads, -1) for lin in (att.q_proj, att.k_proj, att.v_proj))
    heads = []
    for i in range(att.num_heads):
        s = q[:, i] @ k[:, i].T / math.sqrt(att.head_dim)
        heads.append(torch.softmax(s, -1) @ v[:, i])
    x1 = x + att.out_proj(torch.cat(heads, -1))
    h2 = torch.nn.functional.layer_norm(x1, x.shape[-1:], layer.layer_norm2.weight, layer.layer_norm2.bias, 1e-6)
    fc1 = layer.mlp.fc1(h2)
    gelu_tanh = 0.5 * fc1 * (1 + torch.tanh(math.sqrt(2 / math.pi) * (fc1 + 0.044715 * fc1**3)))
    want = x1 + layer.mlp.fc2(gelu_tanh)
    torch.testing.assert_close(layer(x, [5]), want, rtol=1e-5, atol=1e-5)
    # Two packed images do not see each other.
    y = torch.randn(3, x.shape[1], generator=torch.Generator().manual_seed(7))
    packed = layer(torch.cat([x, y]), [5, 3])
    torch.testing.assert_close(packed[:5], layer(x, [5]), rtol=1e-5, atol=1e-6)
    # Images of one size go through one batched call: the same as each image alone, and still apart.
    z = torch.randn(5, x.shape[1], generator=torch.Generator().manual_seed(8))
    batched = layer(torch.cat([x, z]), [5, 5])
    torch.testing.assert_close(batched, torch.cat([layer(x, [5]), layer(z, [5])]), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------ VAE


def test_vae_shapes_and_determinism(loaded):
    vae = loaded.vae
    img = torch.rand(1, 3, 64, 48, generator=torch.Generator().manual_seed(8)) * 2 - 1
    z1 = vae.encode(img, generator=torch.Generator().manual_seed(9))
    z2 = vae.encode(img, generator=torch.Generator().manual_seed(9))
    z3 = vae.encode(img, generator=torch.Generator().manual_seed(10))
    assert z1.shape == (1, 16, 8, 6) and z1.dtype == torch.float32
    assert torch.equal(z1, z2) and not torch.equal(z1, z3)
    mean, logvar = vae.encode_moments(img)
    noise = torch.randn(mean.shape, generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(z1, 0.3611 * (mean + torch.exp(0.5 * logvar) * noise - 0.1159))
    torch.testing.assert_close(vae.encode(img, noise=noise), z1)
    torch.testing.assert_close(vae.encode(img, sample=False), 0.3611 * (mean - 0.1159))
    out = vae.decode(z1)
    assert out.shape == (1, 3, 64, 48) and torch.isfinite(out).all() and out.std() > 0.05
    # decode undoes the scale/shift before the decoder network.
    torch.testing.assert_close(out, vae.decoder(z1 / 0.3611 + 0.1159))


def test_vae_rejects_bad_sizes(loaded):
    with pytest.raises(ValueError, match="multiples of 8"):
        loaded.vae.encode(torch.zeros(1, 3, 60, 48))
    with pytest.raises(ValueError, match="noise"):
        loaded.vae.encode(torch.zeros(1, 3, 64, 48), noise=torch.zeros(1, 16, 4, 4))


def test_real_size_model_on_meta_matches_the_official_layout(tmp_path):
    """BAGEL-7B-MoT configs (Qwen2.5-7B LLM, SigLIP so400m with 27 layers in the file) → 1223 tensors whose
    shapes follow docs/bagel.md §1.2, built on the meta device (no memory)."""
    import json

    from unicache_core.bagel.config import load_bagel_config

    (tmp_path / "llm_config.json").write_text(
        json.dumps(
            {
                "hidden_size": 3584,
                "intermediate_size": 18944,
                "num_hidden_layers": 28,
                "num_attention_heads": 28,
                "num_key_value_heads": 4,
                "vocab_size": 152064,
                "rope_theta": 1000000.0,
                "rms_norm_eps": 1e-6,
                "max_position_embeddings": 32768,
                "hidden_act": "silu",
                "tie_word_embeddings": True,
            }
        )
    )
    (tmp_path / "vit_config.json").write_text(
        json.dumps(
            {
                "hidden_size": 1152,
                "intermediate_size": 4304,
                "num_attention_heads": 16,
                "num_hidden_layers": 27,
                "image_size": 980,
                "patch_size": 14,
            }
        )
    )
    cfg = load_bagel_config(tmp_path)
    assert cfg.vit.num_hidden_layers == 26  # the last SigLIP layer is dropped at load time
    assert cfg.llm.qk_norm and not cfg.llm.tie_word_embeddings  # official overrides
    with torch.device("meta"):
        model = Bagel(cfg)
    sd = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert len(sd) == 1223
    H, d, V, I, Hv, Iv = 3584, 128, 152064, 18944, 1152, 4304
    expect = {
        "language_model.model.embed_tokens.weight": (V, H),
        "language_model.lm_head.weight": (V, H),
        "language_model.model.layers.27.self_attn.q_proj_moe_gen.weight": (28 * d, H),
        "language_model.model.layers.27.self_attn.k_proj.bias": (4 * d,),
        "language_model.model.layers.0.self_attn.o_proj_moe_gen.weight": (H, 28 * d),
        "language_model.model.layers.0.self_attn.k_norm_moe_gen.weight": (d,),
        "language_model.model.layers.13.mlp_moe_gen.down_proj.weight": (H, I),
        "language_model.model.norm_moe_gen.weight": (H,),
        "vit_model.vision_model.embeddings.patch_embedding.weight": (Hv, 3 * 14 * 14),
        "vit_model.vision_model.embeddings.position_embedding.weight": (4900, Hv),
        "vit_model.vision_model.encoder.layers.25.mlp.fc1.weight": (Iv, Hv),
        "connector.fc1.weight": (H, Hv),
        "connector.fc2.weight": (H, H),
        "vit_pos_embed.pos_embed": (4900, H),
        "latent_pos_embed.pos_embed": (4096, H),
        "time_embedder.mlp.0.weight": (H, 256),
        "vae2llm.weight": (H, 64),
        "llm2vae.weight": (64, H),
    }
    for key, shape in expect.items():
        assert sd[key] == shape, key
    assert "vit_model.vision_model.encoder.layers.26.mlp.fc1.weight" not in sd
    n_params = sum(math.prod(s) for s in sd.values())
    assert 14.0e9 < n_params < 15.0e9  # 7B active, two experts stored


def test_mixed_routing_puts_each_expert_output_back_at_its_token():
    gen_mask = torch.tensor([False, True, True, False, True, False, False])
    routing = Routing.from_mask(gen_mask, 7)
    x = torch.randn(7, 3)
    out = routing.apply(lambda t: t * 2, lambda t: t + 100, x)
    assert routing.kind == "mixed"
    assert torch.equal(out[gen_mask], x[gen_mask] + 100) and torch.equal(out[~gen_mask], x[~gen_mask] * 2)
    # gradients reach the right tokens through the gather
    x.requires_grad_(True)
    routing.apply(lambda t: t * 2, lambda t: t * 3, x).sum().backward()
    assert torch.equal(x.grad[:, 0], torch.where(gen_mask, 3.0, 2.0))


# ------------------------------------------------------------------------------------------ operations seam


def _watching_operations(reads: list) -> type:
    """A namespace of torch's layers that records every ``weight``/``bias`` read made outside the layer's own
    forward (a host's casting layers only bring their weights inside ``forward``)."""

    def watched(base: type) -> type:
        class Watched(base):
            def forward(self, *args, **kwargs):
                self.__dict__["_in_forward"] = True
                try:
                    return super().forward(*args, **kwargs)
                finally:
                    self.__dict__["_in_forward"] = False

            def __getattr__(self, name):
                if name in ("weight", "bias") and not self.__dict__.get("_in_forward", False):
                    reads.append((base.__name__, name))
                return super().__getattr__(name)

        Watched.__name__ = f"Watched{base.__name__}"
        return Watched

    return type("WatchedOperations", (), {n: watched(getattr(TorchOperations, n)) for n in REQUIRED_LAYERS})


def _every_output(model: Bagel, vae: AutoEncoder) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    ids = torch.arange(2, 12)
    pos = torch.arange(10)
    cache = FullKVCache(model.num_layers)
    text = model.forward_llm(model.embed_text(ids), pos, cache, _call(10, pos, causal=True))
    lat = model.embed_latents(torch.randn(4, 64, generator=gen), model.latent_position_ids(2, 2), 0.3)
    block = torch.cat([model.embed_text(torch.tensor([1])), lat, model.embed_text(torch.tensor([2]))])
    bpos = torch.full((6,), 10)
    hidden = model.forward_llm(
        block,
        bpos,
        cache,
        _call(6, bpos, causal=False, update=False),
        torch.tensor([False, True, True, True, True, False]),
    )
    image = torch.rand(3, 28, 28, generator=gen) * 2 - 1
    z = vae.encode(image[None, :, :24, :24], generator=torch.Generator().manual_seed(1))
    return {
        "logits": model.lm_logits(text),
        "velocity": model.latent_velocity(hidden[1:-1]),
        "vit": model.embed_vit(image),
        "latent": z,
        "pixels": vae.decode(z),
    }


def test_every_weight_layer_comes_from_operations_and_is_only_called(model: Bagel, loaded):
    """Built from a namespace, every weight-bearing layer but BAGEL's own RMSNorms and sin-cos tables is one of
    its classes, BAGEL's code never reads their weights outside their forward, and the outputs equal the
    default build's exactly."""
    reads: list = []
    ops = _watching_operations(reads)
    watched = Bagel(loaded.config, operations=ops)
    watched.load_state_dict(model.state_dict())
    watched_vae = AutoEncoder(loaded.config.ae, operations=ops)
    watched_vae.load_state_dict(loaded.vae.state_dict())
    layer_classes = tuple(getattr(ops, n) for n in REQUIRED_LAYERS)
    for root in (watched, watched_vae):
        for name, module in root.named_modules():
            if next(module.parameters(recurse=False), None) is not None:
                assert isinstance(module, layer_classes + (Qwen2RMSNorm, PositionEmbedding)), name
    assert sum(isinstance(m, layer_classes) for m in watched.modules()) > 50
    reads.clear()
    got = _every_output(watched, watched_vae)
    assert reads == []
    want = _every_output(model, loaded.vae)
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_storage_dtype_needs_a_compute_dtype(loaded):
    """A ComfyUI-style build (layers stored in fp8, hidden states in bf16) allocates as asked."""
    model = Bagel(
        loaded.config, operations=TorchOperations, dtype=torch.float16, compute_dtype=torch.bfloat16, device="meta"
    )
    assert model.dtype == torch.bfloat16 and model.device.type == "meta"
    assert model.language_model.model.layers[0].mlp.up_proj.weight.dtype == torch.float16
    assert model.vit_pos_embed.pos_embed.dtype == torch.bfloat16
    assert model.language_model.model.rotary_emb.inv_freq.device.type == "meta"
