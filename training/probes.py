"""How much a checkpoint's generation path uses the caption (a training diagnostic, docs/shapes.md).

On held-out text-to-image scenes the flow loss of the velocity is measured at fixed timesteps three ways:
with the scene's own caption, with another scene's caption, and with no text (the ``cfg_text`` context).
A model that draws what it is told predicts better with the right caption than with none, and much worse
with a wrong one; a model that ignores the text scores the same three times. The loss is the training
loss (:func:`.bagel_stage.bagel_loss`) on the latent posterior means, with noise fixed by ``seed``, so two
checkpoints are compared on the same inputs.

    python -m training.probes CHECKPOINT [--scenes 48] [--json PATH]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from unicache_core.shapes import world

from .bagel_stage import SampleMaker, bagel_loss
from .batches import Block, Sample, pack
from .config import TrainConfig
from .vae_stage import Pool, to_unit

#: Flow times probed: mostly structure is decided at high noise, where the caption matters most.
PROBE_TIMES: tuple[float, ...] = (0.3, 0.6, 0.9)
CONDITIONS: tuple[str, ...] = ("right", "wrong", "none")
#: The probe's scenes start here in the evaluation range (apart from the quality benchmark's seeds).
PROBE_SEED_OFFSET = 12345


@torch.no_grad()
def caption_use(
    model, vae, tokenizer, *, scenes: int = 48, times: tuple[float, ...] = PROBE_TIMES, seed: int = 7
) -> dict[str, dict[str, float]]:
    """``{str(t): {"right" | "wrong" | "none": velocity MSE}}`` over ``scenes`` held-out scenes.

    ``model`` is a :class:`~unicache_core.bagel.modeling.Bagel` (fp32 on CPU), ``vae`` its autoencoder; the
    wrong caption of scene ``i`` is the caption of scene ``i + 1``.
    """
    if scenes < 2:
        raise ValueError(f"scenes must be >= 2 (a wrong caption is another scene's), got {scenes}")
    was_training = model.training
    model.eval()
    pairs = [world.edit_sample(world.EVAL_SEEDS.start + PROBE_SEED_OFFSET + i) for i in range(scenes)]
    mean, _ = vae.encode_moments(torch.stack([to_unit(e.source.render()) for e in pairs]))
    sides = torch.stack([mean, mean], 1)  # [scenes, 2, C, h, w]: the source on both sides, std 0
    maker = SampleMaker(TrainConfig(), model.config, Pool(pairs, sides, torch.zeros_like(sides)), tokenizer, vae)
    cfg = TrainConfig()
    out: dict[str, dict[str, float]] = {}
    for t in times:
        row = {}
        for cond in CONDITIONS:
            gen = torch.Generator().manual_seed(seed)
            samples = []
            for i, edit in enumerate(pairs):
                x0 = maker.latent(i, 0, gen)
                eps = torch.randn(x0.shape, generator=gen)
                noisy = Block("noisy", latent=(1 - t) * x0 + t * eps, grid=maker.grid, timestep=t, target=eps - x0)
                caption = {
                    "right": edit.source.caption(),
                    "wrong": pairs[(i + 1) % scenes].source.caption(),
                    "none": None,
                }[cond]
                samples.append(Sample("t2i", ([maker.text(caption)] if caption else []) + [noisy]))
            batch = pack(
                {"t2i": samples, "edit": [], "und": []},
                start_id=tokenizer.start_of_image,
                end_id=tokenizer.end_of_image,
                vit_patch=model.config.vit.patch_size,
                max_latent_size=model.config.max_latent_size,
            )
            row[cond] = bagel_loss(model, batch, cfg)[1]
        out[str(t)] = row
    model.train(was_training)
    return out


def main(argv: list[str] | None = None) -> int:
    from unicache_core.bagel import load_bagel
    from unicache_core.cli import OneLineParser, path_arg

    parser = OneLineParser(description="How much a shapes checkpoint's text-to-image path uses the caption.")
    parser.add_argument("checkpoint", type=path_arg, help="a checkpoint folder (official layout)")
    parser.add_argument("--scenes", type=int, default=48, help="held-out scenes (>= 2)")
    parser.add_argument("--json", type=path_arg, default=None, help="write the result here")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = parser.parse_args(argv)
    if args.scenes < 2:
        parser.error(f"--scenes must be >= 2, got {args.scenes}")
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_bagel(args.checkpoint, dtype=torch.float32)
    if loaded.vae is None:
        parser.error(f"{args.checkpoint} has no VAE (ae.safetensors); the probe encodes scenes with it")
    mse = caption_use(loaded.model, loaded.vae, loaded.tokenizer, scenes=args.scenes)
    result = {
        "checkpoint": str(args.checkpoint),
        "scenes": args.scenes,
        "mse": {t: {c: round(v, 4) for c, v in row.items()} for t, row in mse.items()},
    }
    lines = ["t      right   wrong   none    none - right"]
    for t, row in result["mse"].items():
        lines.append(
            f"{t:<6} {row['right']:.4f}  {row['wrong']:.4f}  {row['none']:.4f}  {row['none'] - row['right']:+.4f}"
        )
    sys.stdout.write("\n".join(lines) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
