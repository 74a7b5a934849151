"""Flow schedule, CFG combination, latent packing and token sampling of BAGEL (docs/bagel.md §5.3)."""

import math

import pytest
import torch

from unicache_core.bagel.sampling import (
    cfg_active,
    combine_cfg,
    next_token,
    pack_latent,
    timestep_schedule,
    unpack_latent,
)


@pytest.mark.parametrize("n, shift", [(5, 3.0), (50, 3.0), (2, 1.0), (7, 1.0)])
def test_schedule_matches_formula(n, shift):
    ts, dts = timestep_schedule(n, shift)
    assert ts.shape == (n - 1,) and dts.shape == (n - 1,) and ts.dtype == torch.float32
    full = [1 - i / (n - 1) for i in range(n)]
    full = [shift * t / (1 + (shift - 1) * t) for t in full]
    for i in range(n - 1):
        assert math.isclose(ts[i].item(), full[i], abs_tol=1e-6)
        assert math.isclose(dts[i].item(), full[i] - full[i + 1], abs_tol=1e-6)
    assert ts[0].item() == 1.0
    assert math.isclose(dts.sum().item(), 1.0, abs_tol=1e-5)


def test_schedule_rejects_bad_args():
    with pytest.raises(ValueError, match="num_timesteps"):
        timestep_schedule(1, 3.0)
    with pytest.raises(ValueError, match="timestep_shift"):
        timestep_schedule(10, 0.0)


def test_cfg_interval_is_open_below_closed_above_in_fp32():
    assert not cfg_active(torch.tensor(0.4), (0.4, 1.0))
    assert cfg_active(torch.tensor(0.41), (0.4, 1.0))
    assert cfg_active(torch.tensor(1.0), (0.4, 1.0))
    assert not cfg_active(torch.tensor(0.0), (0.0, 1.0))
    assert cfg_active(torch.tensor(1e-3), (0.0, 1.0))


def _branches(seed=0, n=6):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 64, generator=g, dtype=torch.float64) for _ in range(3)]


def _clamp(x, lo):
    return min(max(x, lo), 1.0)


@pytest.mark.parametrize("img_scale", [1.0, 2.0])
@pytest.mark.parametrize("renorm_min", [0.0, 0.9])
def test_global_renorm(img_scale, renorm_min):
    v, vt, vi = _branches()
    out = combine_cfg(v, vt, vi, text_scale=4.0, img_scale=img_scale, renorm_type="global", renorm_min=renorm_min)
    a = vt + 4.0 * (v - vt)
    b = vi + img_scale * (a - vi) if img_scale > 1 else a
    s = _clamp(math.sqrt((v**2).sum().item()) / (math.sqrt((b**2).sum().item()) + 1e-8), renorm_min)
    assert torch.allclose(out, b * s, atol=1e-12)


def test_channel_renorm_is_per_token():
    v, vt, vi = _branches(1)
    out = combine_cfg(v, vt, vi, text_scale=3.0, img_scale=1.5, renorm_type="channel", renorm_min=0.0)
    b = vi + 1.5 * ((vt + 3.0 * (v - vt)) - vi)
    for r in range(v.shape[0]):
        s = _clamp(v[r].norm().item() / (b[r].norm().item() + 1e-8), 0.0)
        assert torch.allclose(out[r], b[r] * s, atol=1e-12)


def test_text_channel_renorms_only_the_text_term():
    v, vt, vi = _branches(2)
    out = combine_cfg(v, vt, vi, text_scale=4.0, img_scale=2.0, renorm_type="text_channel", renorm_min=0.0)
    a = vt + 4.0 * (v - vt)
    for r in range(v.shape[0]):
        s = _clamp(v[r].norm().item() / (a[r].norm().item() + 1e-8), 0.0)
        expected = vi[r] + 2.0 * (a[r] * s - vi[r])
        assert torch.allclose(out[r], expected, atol=1e-12)


def test_no_guidance_when_text_scale_at_most_one():
    v, vt, vi = _branches(3)
    for t in (1.0, 0.5):
        out = combine_cfg(v, None, None, text_scale=t, img_scale=3.0, renorm_type="global")
        assert out is v
    with pytest.raises(ValueError, match="cfg_renorm_type"):
        combine_cfg(v, vt, vi, text_scale=4.0, img_scale=2.0, renorm_type="local")


def test_pack_unpack_inverse_and_layout():
    z = torch.randn(16, 6, 10)
    tokens = pack_latent(z)
    assert tokens.shape == (15, 64)
    # token (row 1, col 2), feature (pr=1, pc=0, c=5) = z[5, 2*1+1, 2*2+0]
    assert tokens[1 * 5 + 2, (1 * 2 + 0) * 16 + 5] == z[5, 3, 4]
    back = unpack_latent(tokens, 3, 5)
    assert back.shape == (1, 16, 6, 10) and torch.equal(back[0], z)
    with pytest.raises(ValueError, match="tokens"):
        unpack_latent(tokens, 5, 3, channels=8)


def test_next_token_greedy_and_seeded_sampling():
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    assert next_token(logits, do_sample=False, temperature=1.0, generator=None) == 1
    draws = [
        next_token(logits, do_sample=True, temperature=1.0, generator=torch.Generator().manual_seed(7))
        for _ in range(3)
    ]
    assert len(set(draws)) == 1
    g = torch.Generator().manual_seed(0)
    many = {next_token(logits, do_sample=True, temperature=1.0, generator=g) for _ in range(200)}
    assert {1, 2} <= many
    g = torch.Generator().manual_seed(0)
    cold = {next_token(logits, do_sample=True, temperature=1e-3, generator=g) for _ in range(50)}
    assert cold == {1}
