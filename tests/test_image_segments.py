"""Each input image's rows are segments of their own (issue #43): the caches keep an image's ViT and VAE rows apart,
account them per image (the report's ``images``), UniCache splits a type's budget over the images by the attention
mass their rows draw, and the methods that pool every candidate row still report bytes per image."""

from __future__ import annotations

import pytest
import torch

from unicache_core.compression import make_cache_factory
from unicache_core.compression.report import MANAGED_TYPES, images_snapshot
from unicache_core.compression.view import SegmentKey
from unicache_core.kv.cache import AttentionCall, RequestInfo
from unicache_core.kv.quant import quantized_kv_nbytes
from unicache_core.kv.token_types import TokenType as TT

LAYERS, HKV, D = 2, 2, 16
#: a two-image edit's gen context: per image a VAE block and a ViT block, then the instruction
BLOCKS = [
    (0, [(TT.BOUNDARY, 1), (TT.SOURCE_VAE, 48), (TT.BOUNDARY, 1)]),
    (0, [(TT.BOUNDARY, 1), (TT.SOURCE_VIT, 40), (TT.BOUNDARY, 1)]),
    (1, [(TT.BOUNDARY, 1), (TT.SOURCE_VAE, 48), (TT.BOUNDARY, 1)]),
    (1, [(TT.BOUNDARY, 1), (TT.SOURCE_VIT, 40), (TT.BOUNDARY, 1)]),
    (None, [(TT.BOUNDARY, 1), (TT.INSTRUCTION, 12), (TT.BOUNDARY, 1)]),
]


def _types(parts) -> torch.Tensor:
    return torch.cat([torch.full((n,), int(t), dtype=torch.int8) for t, n in parts])


def _prefill(cache, gen: torch.Generator) -> None:
    """The blocks through the cache's own calls (begin_call / attend / end_call), as the engine appends them."""
    for image, parts in BLOCKS:
        types = _types(parts)
        n = types.shape[0]
        call = AttentionCall(types, torch.zeros(n, dtype=torch.long), causal=False, update=True, image=image)
        cache.begin_call(call)
        for layer in range(LAYERS):
            q = torch.randn(n, HKV, D, generator=gen)
            cache.attend(layer, q, torch.randn(n, HKV, D, generator=gen), torch.randn(n, HKV, D, generator=gen), call)
        cache.end_call(call)


def _session(method: str, **settings):
    return make_cache_factory(method, **settings).start(RequestInfo("edit", LAYERS, 4, "synthetic"))


@pytest.mark.parametrize("method", ["full", "unicache", "unicache-memory", "h2o", "kivi"])
def test_each_images_rows_are_a_segment_and_are_reported_per_image(method):
    objective = "memory" if method == "unicache-memory" else "speed"
    method = method.removesuffix("-memory")
    session = _session(method, objective=objective) if method == "unicache" else _session(method)
    cache = session.new_cache("gen")
    _prefill(cache, torch.Generator().manual_seed(0))
    report_images = images_snapshot(cache)
    assert set(report_images) == {"0", "1"}
    for image in ("0", "1"):
        types = report_images[image]["types"]
        assert {name: t["full_rows"] for name, t in types.items()} == {"source_vae": 48, "source_vit": 40}
        if method != "unicache":
            assert report_images[image]["bytes"] == report_images[image]["full_bytes"] > 0  # nothing compressed yet
            continue
        # UniCache stores an image's rows as they are written (§13): the type its table quantizes (the paper's: the
        # VAE's) at rho0's setting (0.2 of their bytes), and under the memory objective the type it evicts (the ViT's)
        # too, above the floor (2 bits, largest group, one index) here; the bytes are the real store's. Under speed
        # the ViT's rows, not scored as they were prefilled, wait in full precision for the scores to evict them.
        floor = quantized_kv_nbytes(40, HKV, D, 2, 128, 0, 4) + 4 * 40
        if objective == "memory":
            assert LAYERS * floor < types["source_vit"]["bytes"] <= 0.2 * 40 * LAYERS * 2 * HKV * D * 4
        else:
            assert types["source_vit"]["bytes"] == 40 * LAYERS * 2 * HKV * D * 4
        assert 0 < types["source_vae"]["bytes"] < 48 * LAYERS * 2 * HKV * D * 4 // 2
    if method == "full":
        return
    layer = cache.layer(0)
    keys = {(s.token_type, s.image) for s in layer.stores if s.token_type in (TT.SOURCE_VAE, TT.SOURCE_VIT)}
    assert keys == {(TT.SOURCE_VAE, 0), (TT.SOURCE_VIT, 0), (TT.SOURCE_VAE, 1), (TT.SOURCE_VIT, 1)}
    assert cache.segment_rows(0)[SegmentKey(TT.SOURCE_VIT, 1)] == 40
    assert cache.segment_rows(0)[SegmentKey(TT.BOUNDARY, None)] == 10  # boundaries stay one protected store


def _compress_with_masses(method: str, masses: dict, **settings):
    """Prefill, then one observed step whose ViT masses favour one image; compress; the cache."""
    session = _session(method, **settings)
    cache = session.new_cache("gen")
    gen = torch.Generator().manual_seed(1)
    _prefill(cache, gen)
    for layer in range(LAYERS):
        ls = cache.state[layer]
        ls.scores = torch.rand(cache.layer(layer).appended_tokens, HKV, generator=gen)
        ls.last_scores = ls.scores
        ls.masses = {TT.SOURCE_VIT: sum(masses.values()), TT.SOURCE_VAE: 0.2, TT.INSTRUCTION: 0.1}
        ls.segment_masses = {SegmentKey(TT.SOURCE_VIT, image): m for image, m in masses.items()} | {
            SegmentKey(TT.SOURCE_VAE, image): 0.1 for image in masses
        }
        session.state.note_masses("gen", layer, 0, ls.masses)
    step0 = AttentionCall(
        _types([(TT.CURRENT_LATENT, 4)]), torch.zeros(4, dtype=torch.long), False, False, phase="denoise", step=0
    )
    session.compress(cache, step0)
    return session, cache


def test_unicache_splits_a_types_budget_over_the_images_by_their_mass():
    # a target under the ViT rows' written floor: the budget decides which image keeps more of them
    _, cache = _compress_with_masses("unicache", {0: 0.5, 1: 0.05}, kv_target=0.05)
    for layer in range(LAYERS):
        vit = {s.image: s for s in cache.layer(layer).stores if s.token_type == TT.SOURCE_VIT}
        assert set(vit) == {0, 1}, "each image's ViT rows keep a store of their own"
        assert vit[0].num_tokens > vit[1].num_tokens  # the image the queries look at keeps more of its rows
        held = sum(s.nbytes() for s in cache.layer(layer).stores if s.token_type in MANAGED_TYPES)
        assert held <= cache.managed_full_bytes(layer)
    images = images_snapshot(cache)
    assert images["0"]["types"]["source_vit"]["bytes"] > images["1"]["types"]["source_vit"]["bytes"]
    swapped = images_snapshot(_compress_with_masses("unicache", {0: 0.05, 1: 0.5}, kv_target=0.05)[1])
    assert swapped["1"]["types"]["source_vit"]["bytes"] > swapped["0"]["types"]["source_vit"]["bytes"]


def test_a_method_that_pools_every_row_still_reports_bytes_per_image():
    session, cache = _compress_with_masses("h2o", {0: 0.5, 1: 0.05}, kv_target=0.2)
    pooled = [s for s in cache.layer(0).stores if s.token_type == TT.UNKNOWN]
    assert len(pooled) == 1 and pooled[0].image is None  # one store over both images (and the instruction)
    images = images_snapshot(cache)
    held = sum(v["bytes"] for v in images.values())
    assert 0 < held < sum(v["full_bytes"] for v in images.values())
    view = session.view(cache)
    assert view.layer(0).segment_rows[SegmentKey(TT.SOURCE_VAE, 1)] == 48
    report = session.finish()
    assert set(report["summary"]["images"]) == {"0", "1"}
    assert all(v["held_bytes"] <= v["full_bytes"] for v in report["summary"]["images"].values())


def test_the_report_views_show_bytes_per_image():
    from unicache_core.compression.report_view import chart_data, render_plot

    session, _ = _compress_with_masses("unicache", {0: 0.5, 1: 0.05}, kv_target=0.2)
    report = session.finish()
    data = chart_data(report)
    assert set(data["images"]) == {"0", "1"}
    assert all(0 < v["held_bytes"] < v["full_bytes"] for v in data["images"].values())
    assert render_plot(report).size == (768, 512)
