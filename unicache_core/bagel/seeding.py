"""The request generator: one CPU ``torch.Generator`` per seed, with a distinct stream for every 64-bit seed.

``torch.Generator.manual_seed`` accepts any seed in ``[0, 2**64 - 1]``, but the CPU Mersenne Twister
(MT19937) keeps only its low 32 bits. Seeds ``s`` and ``s + 2**32`` would then give the same noise.

Mapping used here:

* ``seed < 2**32``: ``torch.Generator().manual_seed(seed)``, unchanged. This is the official
  stream, so results stay equivalent to the official code.
* ``seed >= 2**32``: MT19937 is initialised with the reference ``init_by_array`` over the seed's two
  32-bit words ``[seed & 0xFFFFFFFF, seed >> 32]``. This is the state Python's
  ``random.seed(seed)`` produces. The state is set on the torch generator, and
  ``generator.initial_seed()`` reports ``seed``. Distinct seeds give distinct states, and none of them
  equals a ``manual_seed`` state.

The state layout of the CPU generator is checked against ``manual_seed`` on first use. If a future
torch changes it, seeds ``>= 2**32`` are refused with a ``ValueError``; nothing falls back silently.
"""

from __future__ import annotations

import functools
import numbers
import random
import struct
from typing import cast

import torch

from ..validation import is_integer

#: Largest accepted seed (torch generators take unsigned 64-bit seeds).
MAX_SEED = 2**64 - 1
_N = 624  # MT19937 state words
_HEAD = struct.Struct("<QiiQ")  # the_initial_seed, left, seeded, next (torch's legacy CPU state header)


def _init_genrand(seed: int) -> list[int]:
    """MT19937 ``init_genrand`` (what ``manual_seed`` does with the low 32 bits)."""
    state = [seed & 0xFFFFFFFF]
    for j in range(1, _N):
        prev = state[-1]
        state.append((1812433253 * (prev ^ (prev >> 30)) + j) & 0xFFFFFFFF)
    return state


def _pack_state(template: bytes, seed: int, words: list[int]) -> torch.Tensor:
    """A CPU generator state: ``template``'s layout with ``words`` as the MT state, ``seed`` as the initial seed."""
    body = _HEAD.pack(seed, 1, 1, 0) + struct.pack(f"<{_N}Q", *words)
    data = bytearray(template)
    data[: len(body)] = body
    return torch.frombuffer(data, dtype=torch.uint8).clone()


@functools.lru_cache(maxsize=1)
def _layout_ok() -> bool:
    """Does this torch's CPU generator state have the layout :func:`_pack_state` writes?"""
    probe = 5489
    template = bytes(torch.Generator().manual_seed(probe).get_state().numpy())
    if len(template) < _HEAD.size + 8 * _N:
        return False
    rebuilt = _pack_state(template, probe, _init_genrand(probe))
    if bytes(rebuilt.numpy()) != template:
        return False
    # and the generator accepts it and reproduces the stream
    gen = torch.Generator()
    gen.set_state(rebuilt)
    return torch.equal(torch.randn(8, generator=gen), torch.randn(8, generator=torch.Generator().manual_seed(probe)))


def check_seed(seed: object) -> int:
    """A request's seed: ``None`` gives a random one; else an int in ``[0, 2**64 - 1]``, or a ValueError."""
    if seed is None:
        return random.SystemRandom().randrange(0, 2**63)
    # is_integer admits exactly the numbers.Integral kinds (bools excluded), which int() converts exactly
    number = int(cast(numbers.Integral, seed)) if is_integer(seed) else None
    if number is None or not 0 <= number <= MAX_SEED:
        raise ValueError(f"`seed` must be an integer in [0, 2**64 - 1] or None, got {seed!r}")
    return number


def seeded_generator(seed: int) -> torch.Generator:
    """CPU generator for ``seed`` in ``[0, 2**64 - 1]`` (module docstring: the mapping)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"`seed` must be an integer in [0, 2**64 - 1], got {seed!r}")
    gen = torch.Generator()
    if seed < 2**32:
        return gen.manual_seed(seed)
    if not _layout_ok():
        raise ValueError(
            f"`seed` {seed} >= 2**32 needs the CPU generator state layout of torch 2.x, which this torch "
            f"({torch.__version__}) does not have; use a seed below 2**32"
        )
    words = list(random.Random(seed).getstate()[1][:_N])  # init_by_array([lo32, hi32])
    template = bytes(gen.get_state().numpy())
    gen.set_state(_pack_state(template, seed, words))
    return gen


__all__ = ["MAX_SEED", "check_seed", "seeded_generator"]
