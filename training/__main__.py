"""``python -m training OUT_DIR``: train the shapes model and write its checkpoint.

The state is saved under ``--work`` (default ``OUT_DIR.work``) every ``--save-every`` steps; running
the same command again resumes. ``--steps``/``--vae-steps``/``--und-warmup``/``--pool`` shrink a run (a smoke
run: ``--vae-steps 20 --und-warmup 20 --steps 20 --pool 64``).
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from unicache_core.cli import OneLineParser, path_arg

logger = logging.getLogger("training")


class _Progress:
    """Progress of the stages on stderr: one line per 5% with the rate and the time left."""

    def __init__(self):
        self.stage, self.t0, self.last = None, 0.0, -1

    def __call__(self, stage: str, done: int, total: int) -> None:
        if stage != self.stage:
            self.stage, self.t0, self.last = stage, time.perf_counter(), -1
        pct = int(100 * done / total) // 5 * 5
        if pct != self.last:
            self.last = pct
            el = time.perf_counter() - self.t0
            eta = el / max(done, 1) * (total - done)
            sys.stderr.write(f"[{stage}] {done}/{total} ({pct}%) {el:.0f}s elapsed, ~{eta:.0f}s left\n")
            sys.stderr.flush()


def _init_spec(value) -> str:
    """A ``TrainConfig.unit_input_init`` value as the CLI spells it."""
    if value is True:
        return "all"
    if value is False:
        return "none"
    return value if isinstance(value, str) else ",".join(value)


def main(argv: list[str] | None = None) -> int:
    from .config import PRECISIONS, TrainConfig, check_und_late_kinds, check_und_warmup_kinds
    from .model import unit_init_modules

    defaults = TrainConfig()
    parser = OneLineParser(
        prog="python -m training", description="Train the bundled shapes BAGEL (VAE, then LLM+ViT) and export it."
    )
    parser.add_argument("out_dir", type=path_arg, help="checkpoint folder to write (official layout)")
    parser.add_argument("--work", type=path_arg, default=None, help="resumable state folder (default OUT_DIR.work)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--vae-steps", type=int, default=defaults.vae_steps)
    parser.add_argument(
        "--steps",
        type=int,
        default=defaults.steps,
        help="BAGEL optimiser steps the learning-rate schedule is laid out for",
    )
    parser.add_argument(
        "--stop-at",
        type=int,
        default=defaults.stop_at,
        help=f"stop and export at this BAGEL step (default {defaults.stop_at}; 0 = --steps): on a "
        "slower machine, the last save inside the hour",
    )
    parser.add_argument("--pool", type=int, default=defaults.pool_size, help="edit pairs encoded for training")
    parser.add_argument(
        "--vae-from",
        type=path_arg,
        default=None,
        help="a finished run's checkpoint folder whose VAE is stage 1 (same VAE settings; its VAE time is counted)",
    )
    parser.add_argument(
        "--unit-input-init",
        nargs="?",
        const="all",
        default=_init_spec(defaults.unit_input_init),
        metavar="MODULES",
        help="start image input modules at N(0, 1/fan_in): all (no value), und (ViT and connector), "
        "none, or a comma list of vit_model, connector, time_embedder, vae2llm",
    )
    parser.add_argument("--und-batch", type=int, default=defaults.batch["und"], help="understanding images per step")
    parser.add_argument(
        "--und-questions",
        type=int,
        default=defaults.und_questions,
        help="questions per understanding image, as turns of one sequence (each of another kind)",
    )
    parser.add_argument(
        "--und-late",
        default=",".join(defaults.und_late_kinds),
        metavar="KINDS",
        help="comma-separated question kinds held back until --und-late-from ('' = none; default "
        f"{','.join(defaults.und_late_kinds)})",
    )
    parser.add_argument("--und-late-from", type=int, default=defaults.und_late_from, metavar="STEP")
    parser.add_argument(
        "--und-warmup",
        type=int,
        default=defaults.und_warmup,
        metavar="STEPS",
        help="understanding warm-up before stage 2: STEPS steps of one-object scenes asked "
        "--und-warmup-kinds questions, the understanding path alone (0 = none; default "
        f"{defaults.und_warmup})",
    )
    parser.add_argument(
        "--und-warmup-kinds",
        default=",".join(defaults.und_warmup_kinds),
        metavar="KINDS",
        help="comma-separated question kinds of the warm-up, taken in turn (default "
        f"{','.join(defaults.und_warmup_kinds)})",
    )
    parser.add_argument(
        "--und-warmup-lr",
        type=float,
        default=defaults.und_warmup_lr,
        help=f"peak learning rate of the warm-up (default {defaults.und_warmup_lr:g})",
    )
    parser.add_argument("--lr", type=float, default=defaults.lr, help="peak AdamW learning rate")
    parser.add_argument(
        "--gen-lr-scale",
        type=float,
        default=defaults.gen_lr_scale,
        help="learning rate of the generation path (gen expert, latent in/out) over --lr",
    )
    parser.add_argument(
        "--ema-decay",
        type=float,
        default=defaults.ema_decay,
        help=f"export an exponential moving average of the BAGEL weights with this decay (0 = the raw "
        f"weights; default {defaults.ema_decay})",
    )
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=defaults.precision,
        help="bf16: matmuls and convolutions under bfloat16 autocast (weights and losses stay fp32)",
    )
    parser.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help="run the decoder layers eagerly (compiling them costs ~30 s once and halves the forward)",
    )
    parser.add_argument("--save-every", type=int, default=defaults.save_every)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = parser.parse_args(argv)
    for name in ("vae_steps", "steps", "pool", "save_every", "und_questions"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.stop_at < 0:
        parser.error(f"--stop-at must be >= 0 (0 = --steps), got {args.stop_at}")
    if args.lr <= 0 or args.gen_lr_scale < 0:
        parser.error(f"--lr must be > 0 and --gen-lr-scale >= 0, got {args.lr} and {args.gen_lr_scale}")
    if not 0.0 <= args.ema_decay < 1.0:
        parser.error(f"--ema-decay must be in [0, 1), got {args.ema_decay}")
    if args.und_warmup < 0 or args.und_warmup_lr <= 0:
        parser.error(
            f"--und-warmup must be >= 0 and --und-warmup-lr > 0, got {args.und_warmup} and {args.und_warmup_lr}"
        )
    if args.und_batch < 0 or args.und_late_from < 0:
        parser.error(f"--und-batch and --und-late-from must be >= 0, got {args.und_batch} and {args.und_late_from}")
    late = [k for k in args.und_late.split(",") if k]
    warmup_kinds = [k for k in args.und_warmup_kinds.split(",") if k]
    try:
        check_und_warmup_kinds(warmup_kinds)
    except ValueError as exc:
        parser.error(f"--und-warmup-kinds: got {args.und_warmup_kinds!r}: {exc}")
    try:
        unit_init_modules(args.unit_input_init)
    except ValueError as exc:
        parser.error(f"--unit-input-init: {exc}")
    unit_init = {"all": True, "none": False, "": False}.get(args.unit_input_init, args.unit_input_init)
    try:
        check_und_late_kinds(late)
    except ValueError as exc:
        parser.error(f"--und-late: {exc}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = TrainConfig(
        seed=args.seed,
        vae_steps=args.vae_steps,
        steps=args.steps,
        stop_at=args.stop_at,
        pool_size=args.pool,
        save_every=args.save_every,
        threads=args.threads,
        vae_from=str(args.vae_from or ""),
        unit_input_init=unit_init,
        batch=dict(defaults.batch, und=args.und_batch),
        und_questions=args.und_questions,
        und_late_kinds=late,
        und_late_from=args.und_late_from,
        und_warmup=args.und_warmup,
        und_warmup_kinds=warmup_kinds,
        und_warmup_lr=args.und_warmup_lr,
        ema_decay=args.ema_decay,
        lr=args.lr,
        gen_lr_scale=args.gen_lr_scale,
        precision=args.precision,
        compile=args.compile,
    )
    out = Path(args.out_dir)
    work = Path(args.work) if args.work else out.with_name(out.name + ".work")
    from .trainer import check_und_warmup_resume, run

    try:
        check_und_warmup_resume(work, cfg)
    except ValueError as exc:
        parser.error(str(exc))
    t = time.perf_counter()
    try:
        info = run(out, work, cfg, _Progress())
    except KeyboardInterrupt:
        sys.stderr.write(f"interrupted; the last saved state is in {work}: run the same command to resume\n")
        return 130
    total = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    sys.stdout.write(
        f"wrote {out} ({total / 1e6:.1f} MB) in {time.perf_counter() - t:.0f}s; "
        f"final loss {info['bagel_log'][-1][1:]}\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
