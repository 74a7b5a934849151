"""Every integer and ratio check of the library says it one way (unicache_core/validation.py): the setting's name,
the bound and the value given."""

from __future__ import annotations

import numpy as np
import pytest

from unicache_core.bagel.sampling import timestep_schedule
from unicache_core.compression.methods.pyramidkv import pyramid_layer_budgets
from unicache_core.compression.methods.vlcache import vlcache_layer_budgets
from unicache_core.compression.routing import route
from unicache_core.compression.stats import ChunkedAttentionStats, step_chunk
from unicache_core.kv.attention import block_causal_mask
from unicache_core.kv.cache import RequestInfo
from unicache_core.validation import check_int, check_ratio


def test_the_checks_take_numpy_numbers_and_refuse_bools():
    assert check_int("n", np.int64(3), 1) == 3 and isinstance(check_int("n", np.int64(3), 1), int)
    assert check_ratio("r", np.float32(0.5)) == 0.5
    with pytest.raises(ValueError, match=r"^`n` must be an integer >= 1, got True$"):
        check_int("n", True, 1)
    with pytest.raises(ValueError, match=r"^`r` must be a number in \[0, 1\), got 1.0$"):
        check_ratio("r", 1.0, allow_zero=True, allow_one=False)
    assert check_ratio("r", 0.0, allow_zero=True, allow_one=False) == 0.0


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: pyramid_layer_budgets(100, 8, 1.0, 4), r"`compression` must be a number in \[0, 1\), got 1.0"),
        (lambda: pyramid_layer_budgets(100, 8, 0.5, 4, beta=0.5), r"`beta` must be a finite number >= 1.0, got 0.5"),
        (lambda: vlcache_layer_budgets([0.5, 1.5], 4, 10), r"`sparsities\[1\]` must be a number in \[0, 1\], got 1.5"),
        (lambda: vlcache_layer_budgets([0.5, 0.5], 1, 10), r"`total` must be an integer >= 2 and <= 20, got 1"),
        (lambda: route(0.5, threshold=-0.1), r"`threshold` must be a number in \[0, 1\], got -0.1"),
        (lambda: step_chunk(3, size=0), r"`size` must be an integer >= 1, got 0"),
        (lambda: ChunkedAttentionStats(decay=1.0), r"`decay` must be a number in \[0, 1\), got 1.0"),
        (lambda: block_causal_mask([3, -1], [True, False]), r"`lengths\[1\]` must be an integer >= 0, got -1"),
        (lambda: RequestInfo("t2i", 0), r"`num_layers` must be an integer >= 1, got 0"),
        (lambda: RequestInfo("t2i", 2, num_steps=-1), r"`num_steps` must be an integer >= 0, got -1"),
        (lambda: timestep_schedule(1, 3.0), r"`num_timesteps` must be an integer >= 2, got 1"),
        (lambda: timestep_schedule(10, 0.0), r"`timestep_shift` must be a finite number > 0.0, got 0.0"),
    ],
)
def test_one_wording_names_the_setting_the_bound_and_the_value(call, message):
    with pytest.raises(ValueError, match=message):
        call()
