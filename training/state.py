"""Resumable training state: weights, AdamW moments, the weight average, the step and the loss log in one
safetensors file with JSON metadata; and the weight average itself (:class:`WeightAverage`)."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor


def _atomic_save(tensors: dict[str, Tensor], path: Path, meta: dict) -> None:
    tmp = path.with_suffix(".tmp")
    save_file(
        {k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp), metadata={"state": json.dumps(meta)}
    )
    os.replace(tmp, path)


def save_state(
    path: Path,
    module: torch.nn.Module,
    opt: torch.optim.Optimizer,
    step: int,
    log: list,
    average: WeightAverage | None = None,
) -> None:
    """Weights and AdamW moments (keyed by parameter name), the weight average if any, the step and loss log."""
    tensors = {f"param.{k}": v for k, v in module.state_dict().items()}
    if average is not None:
        tensors.update({f"ema.{k}": v for k, v in average.shadow.items()})
    names = {id(p): n for n, p in module.named_parameters()}
    steps = {}
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if not st:
                continue
            name = names[id(p)]
            tensors[f"exp_avg.{name}"] = st["exp_avg"]
            tensors[f"exp_avg_sq.{name}"] = st["exp_avg_sq"]
            steps[name] = float(st["step"])
    _atomic_save(tensors, path, {"step": step, "adam_steps": steps, "log": log})


def _saved_meta(path: Path) -> dict:
    with safe_open(str(path), "pt") as f:
        return json.loads(f.metadata()["state"])


def saved_step(path: Path) -> int:
    """The step of a saved state (0 when there is none)."""
    return int(_saved_meta(path)["step"]) if path.is_file() else 0


def saved_log(path: Path) -> list:
    """The loss log of a saved state (``[]`` when there is none)."""
    return list(_saved_meta(path)["log"]) if path.is_file() else []


def load_state(
    path: Path, module: torch.nn.Module, opt: torch.optim.Optimizer, average: WeightAverage | None = None
) -> tuple[int, list]:
    """Restore what :func:`save_state` wrote into ``module``, ``opt`` and ``average``; returns ``(step, log)``."""
    tensors = load_file(str(path))
    saved = {k[4:]: v for k, v in tensors.items() if k.startswith("ema.")}
    if average is None and saved:
        raise ValueError(
            f"{path} holds a weight average but this run has none (ema_decay 0); resume with the run's own settings"
        )
    if average is not None:
        if set(saved) != set(average.shadow):
            raise ValueError(
                f"{path} holds no weight average of this model (ema_decay was 0 when it was saved, or "
                "the model differs); resume with the run's own settings"
            )
        for name, value in saved.items():
            average.shadow[name].copy_(value)
    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["state"])
    module.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("param.")})
    params = dict(module.named_parameters())
    for name, step in meta["adam_steps"].items():
        opt.state[params[name]] = {
            "step": torch.tensor(step),
            "exp_avg": tensors[f"exp_avg.{name}"],
            "exp_avg_sq": tensors[f"exp_avg_sq.{name}"],
        }
    return int(meta["step"]), list(meta["log"])


class WeightAverage:
    """Exponential moving average of a module's trainable parameters (fp32 copies, keyed by name).

    After each optimiser step ``update(step)`` moves every average towards its parameter by ``1 - d`` with
    ``d = min(decay, (1 + step) / (10 + step))``, so early steps, far from the end point, fade fast.
    """

    def __init__(self, module: torch.nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ema decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.params = {n: p for n, p in module.named_parameters() if p.requires_grad}
        self.shadow = {n: p.detach().clone().float() for n, p in self.params.items()}

    @torch.no_grad()
    def update(self, step: int) -> None:
        d = min(self.decay, (1 + step) / (10 + step))
        names = list(self.params)
        torch._foreach_lerp_([self.shadow[n] for n in names], [self.params[n].detach().float() for n in names], 1.0 - d)

    @contextlib.contextmanager
    def swapped_in(self):
        """Within the block the module's parameters hold the averages; the trained values come back after."""
        saved = {n: p.detach().clone() for n, p in self.params.items()}
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.shadow[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(saved[n])
