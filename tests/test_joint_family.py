"""The (rows kept, bits) family: residual and groups that fit the segment, the choice per policy, per-head
quantized rows, and the version-2 policy table that carries joint plans and quantization geometry."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from unicache_core.compression.defaults import JOINT_BITS, JOINT_LEVELS, UNICACHE_GROUPS
from unicache_core.compression.family import (
    FULL_BITS,
    JointChoice,
    JointPlan,
    QuantGeometry,
    Segment,
    choose,
    grid_choices,
    least_quantized_bytes,
    lookup_order,
    plan_from_errors,
)
from unicache_core.compression.ops import compress_rows, quantized_bytes, rows_for_bytes
from unicache_core.compression.policy_table import PolicyTable, PolicyTableError, paper_policy_table
from unicache_core.kv.attention import attention_with_lse
from unicache_core.kv.quantized_store import QuantizedStore
from unicache_core.kv.segmented_cache import SegmentedLayer
from unicache_core.kv.token_types import TokenType as TT

H, D = 2, 32


def _segment(n: int, elem: int = 4, d: int = D) -> Segment:
    return Segment(
        full_rows=n,
        held_rows=n,
        held_bits=FULL_BITS,
        held_bytes=2 * n * H * d * elem,
        shared_rows=True,
        num_kv_heads=H,
        head_dim=d,
        elem=elem,
    )


def test_residual_follows_the_segment_and_the_budget():
    geometry = QuantGeometry()  # at most 32 rows and at most half of the segment
    assert [geometry.residual(n) for n in (1, 15, 16, 25, 64, 4096)] == [0, 7, 8, 12, 32, 32]
    fixed = QuantGeometry(residual_max=4, residual_share=1.0)
    assert [fixed.residual(n) for n in (1, 3, 4, 100)] == [1, 3, 4, 4]
    seg = _segment(64)
    rows = [seg.quantized(64, 2, 128, geometry, int(r * seg.full_bytes)) for r in (0.05, 0.1, 0.2, 0.5)]
    assert rows[0] is None  # not even every row at 2 bits fits
    residuals = [c.residual for c in rows[1:]]
    assert residuals == sorted(residuals) and residuals[-1] > 20  # the residual grows into the budget
    for ratio, choice in zip((0.1, 0.2, 0.5), rows[1:]):
        assert seg.choice_bytes(choice) <= ratio * seg.full_bytes
        assert (
            seg.choice_bytes(replace(choice, residual=choice.residual + 1)) > ratio * seg.full_bytes
            or choice.residual == 32
        )
    with pytest.raises(ValueError, match="residual_share"):
        QuantGeometry(residual_share=1.5)
    with pytest.raises(ValueError, match="groups"):
        QuantGeometry(groups=())


def test_a_64_token_image_is_quantized_not_kept_in_full_precision():
    """The old fixed 32-row residual kept half of a 64-token image in full precision whatever the budget;
    now the bits come first and the residual only takes what the budget leaves."""
    seg = _segment(64)
    choice = choose(seg, "quantize", int(0.2 * seg.full_bytes), QuantGeometry())
    assert choice.rows == 64 and choice.bits == 4
    tight = choose(seg, "quantize", int(0.1 * seg.full_bytes), QuantGeometry())
    assert (tight.rows, tight.bits) == (64, 2) and tight.residual < 4
    assert seg.choice_bytes(tight) <= 0.1 * seg.full_bytes


@pytest.mark.parametrize("kind", ["evict", "quantize", "joint"])
@pytest.mark.parametrize("elem,d", [(4, 32), (2, 32), (2, 128)])
def test_every_choice_fits_its_budget_and_never_exceeds_full(kind, elem, d):
    plan = JointPlan(((0.5, 16), (0.25, 8), (0.12, 4), (0.05, 2)))
    lengths = list(range(1, 200)) + list(range(200, 5001, 97)) + [5000]
    for n in lengths:
        seg = _segment(n, elem, d)
        for ratio in (1.0, 0.6, 0.3, 0.2, 0.1, 0.05, 0.01, 0.0):
            budget = int(ratio * seg.full_bytes)
            choice = choose(seg, kind, budget, QuantGeometry(), plan.bits_for(ratio) if kind == "joint" else None)
            held = seg.full_bytes if (choice.rows, choice.bits) == (n, FULL_BITS) else seg.choice_bytes(choice)
            assert held <= min(budget, seg.full_bytes) or (ratio == 1.0 and held == seg.full_bytes), (n, ratio, choice)
            assert 0 <= choice.rows <= n


def test_the_quantize_route_keeps_every_row_until_its_floor_then_a_subset_at_two_bits():
    seg = _segment(25, elem=2)  # a 25-token bf16 instruction
    floor = least_quantized_bytes(seg, QuantGeometry())
    at_floor = choose(seg, "quantize", floor, QuantGeometry())
    assert (at_floor.rows, at_floor.bits) == (25, 2)
    below = choose(seg, "quantize", floor - 1, QuantGeometry())
    assert below.bits == 2 and 0 < below.rows < 25
    # one bf16 row: 2 bits with its per-channel key scales hold more than the row itself, so it is evicted
    one = _segment(1, elem=2)
    assert choose(one, "quantize", one.full_bytes - 1, QuantGeometry()).rows == 0
    assert choose(one, "quantize", one.full_bytes, QuantGeometry()) == JointChoice(1, FULL_BITS)  # kept


def test_choices_never_grow_rows_or_bits():
    seg = Segment(
        full_rows=100,
        held_rows=40,
        held_bits=4,
        held_bytes=10**9,
        shared_rows=False,
        num_kv_heads=H,
        head_dim=D,
        elem=4,
    )
    for kind, plan_bits in (("evict", None), ("quantize", None), ("joint", 16), ("joint", 8)):
        choice = choose(seg, kind, 10**6, QuantGeometry(), plan_bits)
        assert choice.rows <= 40 and choice.bits <= 4, (kind, choice)
    fits = Segment(
        full_rows=100, held_rows=40, held_bits=4, held_bytes=5000, shared_rows=False, num_kv_heads=H, head_dim=D, elem=4
    )
    assert choose(fits, "quantize", 5000, QuantGeometry()) == JointChoice(40, 4)  # held as it is


def test_joint_plan_levels():
    plan = JointPlan(((0.1, 2), (0.5, 16), (0.25, 4)))
    assert plan.levels == ((0.5, 16), (0.25, 4), (0.1, 2))
    assert [plan.bits_for(r) for r in (1.0, 0.5, 0.3, 0.25, 0.2, 0.1, 0.01)] == [16, 16, 4, 4, 2, 2, 2]
    assert JointPlan.from_list(plan.to_list()) == plan
    with pytest.raises(ValueError, match="bits"):
        JointPlan(((0.5, 3),))
    with pytest.raises(ValueError, match="repeats"):
        JointPlan(((0.5, 2), (0.5, 4)))


def test_joint_rows_are_chosen_per_head_and_quantized_exactly_as_kept():
    gen = torch.Generator().manual_seed(0)
    t = 96
    k, v = torch.randn(t, H, D, generator=gen), torch.randn(t, H, D, generator=gen)
    layer = SegmentedLayer()
    layer.append(k, v, torch.full((t,), int(TT.SOURCE_VIT), dtype=torch.int8))
    scores = torch.rand(t, H, generator=gen)
    store = compress_rows(layer, [0], JointChoice(30, 4, 32, 2), scores)
    assert isinstance(store, QuantizedStore) and store.per_head_rows and store.num_tokens == 30
    assert store.nbytes() == store.nominal_bytes() == quantized_bytes(30, H, D, 4, 32, 2, 4, span=t)
    for h in range(H):  # each head keeps its own 30 best-scored rows
        assert set(store.token_index[h].tolist()) == set(torch.topk(scores[:, h], 30).indices.tolist())
    assert not torch.equal(store.token_index[0], store.token_index[1])
    # attention over the store equals attention over its dequantized rows, head by head
    q = torch.randn(5, 4, D, generator=gen)
    dk, dv = store.dequantize()
    out, _ = store.attend(q)
    ref, _ = attention_with_lse(q, dk, dv)
    assert torch.allclose(out, ref, atol=1e-5)
    kept = store.token_index.long()  # the residual rows (each head's two best-scored) are exact
    for h in range(H):
        assert set(kept[h, -2:].tolist()) == set(torch.topk(scores[:, h], 2).indices.tolist())
        assert torch.equal(dk[-2:, h], k[kept[h, -2:], h]) and not torch.equal(dk[:-2, h], k[kept[h, :-2], h])
    smaller = compress_rows(layer, [0], JointChoice(12, 2, 128, 0), scores)  # shrinking again keeps a subset
    assert all(set(smaller.token_index[h].tolist()) <= set(kept[h].tolist()) for h in range(H))


def test_the_policy_table_carries_joint_plans_and_geometry(tmp_path):
    paper = paper_policy_table()
    assert paper.geometry == QuantGeometry() and paper.to_dict()["version"] == 2
    plan = JointPlan(((0.4, 8), (0.1, 2)))
    key = ("edit", TT.SOURCE_VIT)
    table = PolicyTable(
        entries={**paper.entries, key: "joint"},
        plans={key: plan},
        model_id="m",
        geometry=QuantGeometry(groups=(32, 64), residual_max=8, residual_share=0.125),
    )
    table.save(tmp_path / "t.json")
    loaded = PolicyTable.load(tmp_path / "t.json")
    assert loaded.kind(*key) == "joint" and loaded.plan_for(*key) == plan and loaded.geometry == table.geometry
    # a version-1 table (no geometry, no joint entries) still loads, with the default geometry
    data = json.loads((tmp_path / "t.json").read_text())
    data["version"] = 1
    del data["quantization"]
    data["entries"] = [e for e in data["entries"] if e["kind"] != "joint"]
    (tmp_path / "v1.json").write_text(json.dumps(data))
    assert PolicyTable.load(tmp_path / "v1.json").geometry == QuantGeometry()
    data = json.loads((tmp_path / "t.json").read_text())
    for entry in data["entries"]:
        entry.pop("plan", None)
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(PolicyTableError, match="joint but has no `plan`"):
        PolicyTable.load(tmp_path / "bad.json")
    data["quantization"] = {"groups": [32], "residual": 3}
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(PolicyTableError, match="unknown keys"):
        PolicyTable.load(tmp_path / "bad.json")


def test_the_grid_matches_bytes_across_bit_widths():
    """At each level every bit width keeps the most rows that fit ``level`` of the full bytes: fewer bits keep
    more rows, full precision keeps exactly the rows an eviction budget buys, and a bit width that keeps no row
    is left out of the grid."""
    seg = _segment(64, elem=2)
    grid = grid_choices(seg, QuantGeometry())
    assert {level for level, _ in grid} == set(JOINT_LEVELS)
    for level in JOINT_LEVELS:
        budget = int(level * seg.full_bytes)
        row = {bits: grid[(level, bits)] for bits in JOINT_BITS if (level, bits) in grid}
        for bits, choice in row.items():
            assert choice.bits == bits and 0 < choice.rows <= 64
            assert seg.choice_bytes(choice) <= budget  # matched bytes: every point within the level's budget
            if choice.rows < 64:  # one more row would not fit
                more = (
                    seg.quantized(choice.rows + 1, bits, max(QuantGeometry().groups), QuantGeometry(), budget)
                    if bits != FULL_BITS
                    else None
                )
                assert more is None
        rows = [row[b].rows for b in JOINT_BITS if b in row]
        assert rows == sorted(rows)  # 16, 8, 4, 2 bits: more rows as the bits fall
        if FULL_BITS in row:
            assert row[FULL_BITS].rows == rows_for_bytes(budget, seg.full_rows, H, D, 2)
    # one bf16 row at 6% of its bytes: no bit width keeps it
    assert grid_choices(_segment(1, elem=2), QuantGeometry(), levels=(0.06,)) == {}


def test_plan_from_errors_takes_each_levels_least_change():
    errors = {
        (0.5, 16): 0.01,
        (0.5, 8): 0.02,
        (0.25, 16): 0.3,
        (0.25, 8): 0.1,
        (0.25, 4): 0.1,
        (0.12, 4): 0.4,
        (0.12, 2): 0.2,
    }
    plan = plan_from_errors(errors)
    assert plan.levels == ((0.5, 16), (0.25, 4), (0.12, 2))  # the 0.25 tie goes to fewer bits (more rows)
    assert [plan.bits_for(r) for r in (0.9, 0.3, 0.2, 0.01)] == [16, 4, 2, 2]
    with pytest.raises(ValueError, match="empty"):
        plan_from_errors({})
    with pytest.raises(ValueError, match="nan"):
        plan_from_errors({(0.5, 8): float("nan")})


def test_the_group_rule_most_precise_setting_first():
    """Quantize: bits first (most precise that fits), then the smallest group of those bits that fits; joint at
    the plan's bits: the smallest group when every row fits, else the largest group and fewer rows."""
    seg = _segment(512)
    order = lookup_order(QuantGeometry())
    assert order[0] == (8, 32) and order[-1] == (2, 128) and len(order) == 9
    for ratio in (0.3, 0.2, 0.12, 0.095):  # 2-bit G128 holds 0.09 of fp32 rows at d = 32
        budget = int(ratio * seg.full_bytes)
        choice = choose(seg, "quantize", budget, QuantGeometry())
        first = next((b, g) for b, g in order if seg.quantized(512, b, g, QuantGeometry(), budget) is not None)
        assert (choice.bits, choice.group) == first and choice.rows == 512
    every_row = choose(seg, "joint", int(0.2 * seg.full_bytes), QuantGeometry(), plan_bits=4)
    assert (every_row.rows, every_row.bits, every_row.group) == (512, 4, 32)  # 4-bit G32 holds 0.16 of fp32
    subset = choose(seg, "joint", int(0.1 * seg.full_bytes), QuantGeometry(), plan_bits=8)
    assert subset.bits == 8 and subset.group == 128 and 0 < subset.rows < 512
    geometry = QuantGeometry(groups=(16,), residual_max=0, residual_share=0.0)
    assert choose(seg, "quantize", int(0.3 * seg.full_bytes), geometry).group == 16
    assert choose(seg, "quantize", int(0.3 * seg.full_bytes), geometry).residual == 0
    assert QuantGeometry.from_dict(geometry.to_dict()) == geometry
    assert QuantGeometry.from_dict({}) == QuantGeometry()


def test_the_shipped_tables_load():
    """The paper table (version 2, KIVI's groups, the paper's routes) and the bundled model's calibrated table
    (the groups calibration writes: KIVI's and two finer ones) both load."""
    from unicache_core.bagel.settings import BUNDLED_CHECKPOINT_DIR

    paper = paper_policy_table()
    assert paper.geometry == QuantGeometry(groups=(32, 64, 128), residual_max=32, residual_share=0.5)
    assert paper.kind("edit", "instruction") == "evict" and paper.kind("edit", "source_vae") == "quantize"
    bundled_path = BUNDLED_CHECKPOINT_DIR / "unicache_policy.json"
    bundled = PolicyTable.load(bundled_path)
    assert bundled.source == "calibrated" and bundled.geometry == QuantGeometry(groups=UNICACHE_GROUPS)
    assert bundled.geometry == PolicyTable().geometry and min(UNICACHE_GROUPS) < min(QuantGeometry().groups)
    assert {t for t, _ in bundled.entries} == {"understanding", "t2i", "edit"}
    assert json.loads(bundled_path.read_text())["version"] in (1, 2)
