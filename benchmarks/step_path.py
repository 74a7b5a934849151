"""Step fidelity: a compressed cache's outputs measured on full KV's path (teacher forcing).

A flow's free-running outputs drift apart chaotically: one slightly different velocity early on can send an
edit to another image (32 bench edits at 90% sit between 14 and 44 dB from full KV's), so image PSNR to full
KV's output needs many samples to tell two caches apart. Teacher forcing measures each step instead: the
full-KV run records its path (every step's output and the latent or token it continued from), and a
compressed run is forced along that path (``RunHooks.steer``), so every one of its outputs is computed from
exactly the input full KV's was:

- text-to-image and edit: ``10 log10(sum |v|^2 / sum |v' - v|^2)`` over every step's guided velocity ``v``
  (full KV) and ``v'`` (the compressed cache), in dB;
- understanding: ``-10 log10(mean KL(p || p'))`` over the answer's tokens, ``p`` and ``p'`` the next-token
  distributions of full KV and the compressed cache, in dB (KL in nats).

Higher is closer to full KV; identical outputs read :data:`CAP_DB`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

#: dB given to outputs identical to full KV's (as PSNR to full KV is capped).
CAP_DB = 100.0


class StepPath:
    """A ``RunHooks.steer`` that records a run's path and, given another run's path, forces the run along it.

    Attributes:
        outputs: every step's output (guided velocity ``[h*w, 64]`` or logits ``[vocab]``), fp32 copies.
        nexts: what the run continued from after each step (latent ``[h*w, 64]`` or token id).
    """

    def __init__(self, forced: StepPath | None = None):
        self.forced = forced
        self.outputs: list[Tensor] = []
        self.nexts: list = []

    def __call__(self, step: int, output: Tensor, proposed):
        if step != len(self.outputs):
            raise ValueError(f"step {step} arrived after {len(self.outputs)} recorded steps: one StepPath per run")
        self.outputs.append(output.detach().float().cpu().clone())
        chosen = proposed
        if self.forced is not None and step < len(self.forced.nexts):
            chosen = self.forced.nexts[step]
        self.nexts.append(chosen.clone() if isinstance(chosen, Tensor) else chosen)
        return chosen


def fidelity_db(task: str, path: StepPath, full: StepPath) -> float:
    """Step fidelity of ``path`` (forced along ``full``) to ``full``, in dB (module docstring)."""
    n = len(full.outputs)
    if len(path.outputs) != n:
        raise ValueError(f"the forced run took {len(path.outputs)} steps, full KV's {n}: it left the path")
    if n == 0:
        return CAP_DB
    if task == "und":
        kl = 0.0
        for ref, out in zip(full.outputs, path.outputs):
            p_log, q_log = torch.log_softmax(ref, dim=-1), torch.log_softmax(out, dim=-1)
            kl += float((p_log.exp() * (p_log - q_log)).sum())
        kl = max(kl / n, 0.0)  # rounding can leave a hair below zero
        return CAP_DB if kl == 0.0 else min(CAP_DB, -10.0 * math.log10(kl))
    signal = sum(float(ref.square().sum()) for ref in full.outputs)
    error = sum(float((out - ref).square().sum()) for ref, out in zip(full.outputs, path.outputs))
    return CAP_DB if error == 0.0 else min(CAP_DB, 10.0 * math.log10(signal / error))


__all__ = ["CAP_DB", "StepPath", "fidelity_db"]
