"""Reference LOOK-M: text-prior eviction of the prompt's rows and the merges of the evicted rows.

Paper: Wan et al., "LOOK-M: Look-Once Optimization in KV Cache for Efficient Multimodal Long-Context Inference",
Findings of EMNLP 2024 (https://arxiv.org/abs/2406.18139), §3.2-§3.3; docs/compression.md §14. Written from the
formulas, row by row in plain Python loops, independently of the library's vectorised code:

- the score of a row is the attention it received from every prompt query (dense probabilities, summed over the
  queries, averaged over the query heads of its KV group);
- per KV head the kept rows are the last ``round(k * recent_fraction)`` rows, then the others ranked text first,
  by score within a modality, the newer row on a tie;
- each evicted row goes to the kept row whose key has the highest cosine similarity with its own (the first kept
  row on a tie) and is merged there: averaged ``(c + Σ e) / (1 + n)``; pivotal ``(c + Σ (e + c) / 2) / (1 + n)``;
  weighted: only rows whose similarity is at least the mean similarity of the head's evicted rows,
  ``(c + Σ s e) / (1 + n)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .base import ScoreInputs, observation_attention


@dataclass(frozen=True)
class LOOKMPolicy:
    """LOOK-M's selection and merge over one layer's candidate rows.

    Parameters
    ----------
    recent_fraction : float, default 0.5
        Share of the kept rows that are the most recent (official scripts: ``hh_ratio = recent_ratio = 0.1``).
    text_prior : bool, default True
        Rank every text row above every image row.
    merge : str, default "pivot"
        ``none``, ``average``, ``pivot`` or ``weighted``.
    """

    recent_fraction: float = 0.5
    text_prior: bool = True
    merge: str = "pivot"

    def prompt_scores(self, inputs: ScoreInputs, *, causal: bool) -> Tensor:
        """``[T, Hkv]``: the attention each row received from the prompt's queries (``inputs.queries``, every one
        of them), as shares of the softmax over ``inputs.keys`` (or of ``query_lse`` when given)."""
        return observation_attention(inputs, causal=causal).sum(dim=1).t()

    def select(self, scores: Tensor, text: Tensor, keep: int) -> Tensor:
        """``[Hkv, keep]`` int64 rows kept per KV head, ascending, for ``scores [T, Hkv]`` and ``text [T]`` bool."""
        t, hkv = scores.shape
        keep = max(0, min(int(keep), t))
        recent = min(keep, math.floor(keep * self.recent_fraction + 0.5))
        kept = []
        for head in range(hkv):
            window = list(range(t - recent, t))
            rest = [row for row in range(t) if row < t - recent]
            prior = [bool(text[row]) and self.text_prior for row in range(t)]
            rest.sort(key=lambda row: (prior[row], float(scores[row, head]), row), reverse=True)
            kept.append(sorted(window + rest[: keep - recent]))
        return torch.tensor(kept, dtype=torch.int64).reshape(hkv, keep)

    def merged(self, keys: Tensor, values: Tensor, kept: Tensor) -> tuple[Tensor, Tensor]:
        """``(keys, values)`` ``[Hkv, k, d]`` of the kept rows after the merge; ``keys/values`` are ``[T, Hkv, d]``."""
        t, hkv, d = keys.shape
        out_k = torch.zeros(hkv, kept.shape[1], d, dtype=torch.float64)
        out_v = torch.zeros_like(out_k)
        for head in range(hkv):
            rows = [int(r) for r in kept[head]]
            dropped = [r for r in range(t) if r not in set(rows)]
            k = keys[:, head].double()
            v = values[:, head].double()
            sums_k = [k[r].clone() for r in rows]
            sums_v = [v[r].clone() for r in rows]
            counts = [1.0] * len(rows)
            links = []
            for e in dropped:
                sims = [
                    float(torch.dot(k[e], k[c]) / (k[e].norm().clamp_min(1e-12) * k[c].norm().clamp_min(1e-12)))
                    for c in rows
                ]
                best = max(range(len(rows)), key=lambda j: (sims[j], -j))
                links.append((e, best, sims[best]))
            mean_sim = sum(s for _, _, s in links) / len(links) if links else 0.0
            for e, j, s in links:
                if self.merge == "average":
                    sums_k[j] += k[e]
                    sums_v[j] += v[e]
                elif self.merge == "pivot":
                    sums_k[j] += (k[e] + k[rows[j]]) / 2
                    sums_v[j] += (v[e] + v[rows[j]]) / 2
                elif self.merge == "weighted" and s >= mean_sim:
                    sums_k[j] += s * k[e]
                    sums_v[j] += s * v[e]
                else:
                    continue
                counts[j] += 1.0
            for j in range(len(rows)):
                out_k[head, j] = sums_k[j] / counts[j]
                out_v[head, j] = sums_v[j] / counts[j]
        return out_k, out_v
