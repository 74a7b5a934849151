"""The retention schedule decaying in bits (error parity, docs/compression.md §11.5)."""

from __future__ import annotations

import math

import pytest
import torch
from test_unicache_parts import _observed  # rho after each observed mass, chunk 0 first

from unicache_core.bagel import BagelPipeline, load_bagel, preset
from unicache_core.compression import defaults, make_cache_factory
from unicache_core.compression.methods.unicache import UniCacheState
from unicache_core.compression.schedule import RetentionSchedule


def test_decays_by_the_bits_the_mass_fall_is_worth():
    # fp32 (4 bytes an element): one bit is 1/32 of the retention. Half the mass is worth half a bit (a row's error
    # m * 4**-b stays the same): 0.2 - 0.5/32; a sixteenth of it two bits: 0.2 - 2/32; no mass: the floor.
    fp32 = RetentionSchedule(rho0=0.2, floor=0.1, per_bit=1 / 32)
    assert _observed(fp32, 1.0, 0.5, 1 / 16, 0.0) == pytest.approx([0.2 - 0.5 / 32, 0.2 - 2 / 32, 0.1])
    # bf16: one bit is 1/16; the power law (per_bit None) falls with the mass itself
    bf16 = RetentionSchedule(rho0=0.2, floor=0.1, per_bit=1 / 16)
    assert _observed(bf16, 1.0, 0.5) == pytest.approx([0.2 - 0.5 / 16])
    assert _observed(RetentionSchedule(rho0=0.2, floor=0.1), 1.0, 0.5) == pytest.approx([0.1])
    # a fall under 5% of the rho in force is not acted on, as with the power law
    assert _observed(fp32, 1.0, 0.8) == [0.2]
    with pytest.raises(ValueError, match="per_bit"):
        RetentionSchedule(per_bit=0.0)
    assert math.isclose(fp32.ratio_for(2.0), 0.2)  # a rise stays at rho0 (no reference yet: rho0 too)


def test_unicache_schedules_decay_in_bits_of_the_cache_dtype(tiny_checkpoint):
    loaded = load_bagel(tiny_checkpoint, dtype=torch.float32)
    factory = make_cache_factory("unicache", checkpoint_dir=str(tiny_checkpoint))
    sessions = []
    start = factory.start
    factory.start = lambda request: sessions.append(start(request)) or sessions[-1]  # type: ignore[method-assign]
    pipe = BagelPipeline(loaded, factory)
    pipe.text_to_image("a dog", preset("t2i", num_timesteps=3, width=32, height=32), seed=1)
    state = sessions[-1].state.branch("gen").method_state
    assert isinstance(state, UniCacheState) and state.schedules
    per_bit = 1 / (8 * 4) if defaults.RHO_DECAY_IN_BITS else None  # fp32 cache: 4 bytes an element
    assert {s.per_bit for s in state.schedules.values()} == {per_bit}
