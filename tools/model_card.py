"""Write the bundled model's card, ``models/bagel/unicache-shapes/README.md``, from its training record and a
quality-benchmark report (so the card's numbers are the measured ones).

    .venv/bin/python tools/model_card.py [--checkpoint DIR] [--quality out/quality.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from unicache_commands.flags import OneLineParser
from unicache_commands.output_files import check_outputs, save_text

ROOT = Path(__file__).resolve().parent.parent


def _loss_rows(log: list, names: list[str], every: int) -> list[str]:
    rows = [r for r in log if r[0] % every == 0 or r is log[-1]]
    head = "| step | " + " | ".join(names) + " |"
    return [head, "|" + "---|" * (len(names) + 1)] + [
        "| " + " | ".join([str(r[0])] + [f"{v:.4f}" for v in r[1:]]) + " |" for r in rows
    ]


def _und_questions(cfg: dict) -> str:
    """How the understanding questions were drawn (one per image, or several turns and a kind curriculum)."""
    n = cfg.get("und_questions", 1)
    text = (
        "The question for each image is drawn fresh."
        if n == 1
        else f"Each image gets up to {n} questions of different kinds, drawn fresh, as turns of one sequence."
    )
    late = cfg.get("und_late_kinds") or []
    if late and cfg.get("und_late_from", 0) > 0:
        text += f" The {' and '.join(late)} questions join at step {cfg['und_late_from']}."
        if "background" in late:
            text += (
                " Asked from the start, background (read off the mean colour) kept the object questions at"
                " their answer prior."
            )
    return text


def _warmup_question(kinds: list[str]) -> str:
    """What the warm-up asks each scene, in words."""
    if kinds == ["position"]:
        return "where its object is"
    return "a question of kind " + " or ".join(kinds) + " in turn"


def card(training: dict, quality: dict | None, notes: list[str] | None = None) -> str:
    cfg = training["config"]
    sec = training["seconds"]
    warmup_steps = cfg.get("und_warmup", 0)
    total_min = (sec["vae_s"] + sec["pool_s"] + sec.get("und_warmup_s", 0.0) + sec["bagel_s"]) / 60
    params = training["parameters"]
    rec = training.get("vae_reconstruction", {})
    stop = min(cfg["steps"], cfg.get("stop_at") or cfg["steps"])
    stopped = (
        []
        if stop == cfg["steps"]
        else [
            f"The learning-rate schedule is laid out for {cfg['steps']} BAGEL steps; the run stops at step {stop}",
            "(`stop_at`) to stay under 60 minutes.",
            "",
        ]
    )
    run_notes = (
        []
        if not sec.get("vae_from")
        else [
            "- Stage 1 (the VAE) was taken from an earlier run (`--vae-from`, the same seed and VAE settings,",
            "  checked); its measured VAE time is counted in the total.",
        ]
    )
    init = cfg.get("unit_input_init")
    if init:
        names = init.split(",") if isinstance(init, str) else init
        which = (
            "The image input path (ViT, connector, timestep embedder, `vae2llm`)"
            if init in (True, "all")
            else "The ViT and the connector"
            if init == "und"
            else "The input modules " + ", ".join(f"`{n}`" for n in names)
        )
        run_notes.append(f"- {which} started at unit gain, N(0, 1/fan_in); the other matrices at N(0, 0.02).")
    precision = cfg.get("precision", "fp32")
    run_notes.append(
        "- Matmuls and convolutions under bfloat16 autocast (weights, AdamW state and losses in fp32)."
        if precision == "bf16"
        else "- All in fp32."
    )
    if cfg.get("compile"):
        run_notes.append("- The LLM's decoder layers compiled with `torch.compile` (dynamic shapes).")
    if cfg.get("gen_lr_scale", 1.0) != 1.0:
        run_notes.append(
            f"- The generation path (the gen expert of every layer, `vae2llm`, `llm2vae`, the timestep "
            f"embedder) at {cfg['gen_lr_scale']:g}x the learning rate."
        )
    if warmup_steps:
        run_notes.append(
            f"- Before the BAGEL steps, {warmup_steps} understanding-only warm-up steps: "
            f"{cfg['und_warmup_batch']} one-object scenes a step, each asked "
            f"{_warmup_question(cfg.get('und_warmup_kinds', ['position']))}; the understanding "
            f"path alone, its own AdamW at lr {cfg['und_warmup_lr']:g} "
            "(same warmup and cosine); the BAGEL steps then start from these weights with a "
            "fresh AdamW."
        )
    if cfg.get("ema_decay"):
        run_notes.append(
            f"- `ema.safetensors` holds an exponential moving average of the BAGEL weights (decay "
            f"{cfg['ema_decay']}, ramped up as (1 + step) / (10 + step))."
        )
    run_notes += [f"- {note}" for note in notes or []]
    lines = [
        "# unicache-shapes: a small BAGEL trained on the shapes world",
        "",
        "BAGEL's architecture (Qwen2 Mixture-of-Transformers LLM with und and gen experts, SigLIP NaViT ViT,",
        "MLP connector, FLUX-style VAE) at a small width, in the official folder layout. It is the pack's",
        "bundled default checkpoint. It was trained from scratch by this repository's code on a synthetic",
        "world of coloured shapes (docs/shapes.md), where every caption, edit target and answer is known",
        "exactly. It is a test bed for KV-cache compression, not a general model: it only knows that world.",
        "",
        "## Model",
        "",
        f"- BAGEL part: {params['bagel'] / 1e6:.2f} M parameters (`ema.safetensors`, bf16 as BAGEL ships).",
        "  LLM: hidden 128, 6 MoT layers, 4 query and 2 KV heads of 32, MLP 384. ViT: hidden 64, 2 layers,",
        "  patch 14.",
        f"- VAE: {params['vae'] / 1e6:.2f} M parameters (`ae.safetensors`, fp32). ch 64, ch_mult 1-1-1-1, one",
        "  res block, z 16, downsample 8, FLUX's 32-group norms.",
        f"  Latent shift {training['latent_shift']:.4f} and scale {training['latent_scale']:.4f} were measured",
        "  on the data (`ae_config.json`).",
        "- Images are 128 x 128: 64 VAE tokens (8 x 8) and 64 ViT patches (112 px, 8 x 8) per image.",
        "  The tokenizer is a byte-level BPE trained on the world's text, plus Qwen's special tokens.",
        "",
        "## Data",
        "",
        f"- VAE: random scenes, fresh each step. The first {cfg['vae_crop_steps']} steps use 64 px crops",
        f"  (batch {cfg['vae_batch']}); the rest use whole 128 px images (batch {cfg['vae_full_batch']}).",
        f"  Object pixels get {1 + cfg['vae_fg_weight']:.0f}x loss weight.",
        f"- BAGEL: {cfg['pool_size']} edit pairs from training seeds 0..{cfg['pool_size'] - 1}, encoded once.",
        f"  Each step draws {cfg['batch']['t2i']} text-to-image, {cfg['batch']['edit']} edit and",
        f"  {cfg['batch']['und']} understanding images from the pool. {_und_questions(cfg)}",
        f"- Text is dropped with probability {cfg['drop_text']}, and in edits the images with",
        f"  {cfg['drop_image']}, for classifier-free guidance.",
        "- Evaluation seeds (2^40 and up) are disjoint from the training seeds. Single-object scenes can still",
        "  repeat, since there are only 972 of them.",
        "",
        "## Training",
        "",
        *stopped,
        "- Command: `make train` (= `python -m training models/bagel/unicache-shapes`).",
        *run_notes,
        f"- {training['threads']} torch threads on the project's 2-core CPU machine, "
        f"over {sec['sessions']} session(s).",
        f"- VAE: {cfg['vae_steps']} steps in {sec['vae_s'] / 60:.1f} min. Pool encoding: {sec['pool_s'] / 60:.1f} min.",
        *(
            [f"  Understanding warm-up: {warmup_steps} steps in {sec['und_warmup_s'] / 60:.1f} min."]
            if warmup_steps
            else []
        ),
        f"  BAGEL: {stop} steps in {sec['bagel_s'] / 60:.1f} min. Total: {total_min:.1f} min.",
        f"- AdamW with lr {cfg['lr']}, {cfg['warmup']} warmup steps, cosine decay to {cfg['min_lr_ratio']} of lr,",
        f"  weight decay {cfg['weight_decay']}, gradient clip {cfg['grad_clip']}.",
        f"- Loss: MSE of the flow velocity + {cfg['ce_weight']} x CE on the answer tokens. The timestep is",
        f"  logit-normal, shifted by {cfg['timestep_shift']}.",
        "",
        "VAE loss (weighted L1 + MSE; l1 = plain L1 on [-1, 1] pixels):",
        "",
        *_loss_rows(training["vae_log"], ["loss", "l1"], 100),
        "",
        "BAGEL loss (means over 25-step windows):",
        "",
        *_loss_rows(training["bagel_log"], ["loss", "mse", "ce"], 400),
        "",
    ]
    if rec:
        lines += [
            "The VAE bounds every image score. Reconstructions of held-out scenes (posterior mean) have",
            f"{rec['psnr_db']} dB PSNR, and the analyser reads the exact scene off {rec['analyser_agreement']:.0%}",
            f"of them ({rec['scenes']} scenes).",
            "",
        ]
    if quality is not None:
        full = {r["task"]: r for r in quality["results"] if r["method"] == "full"}
        qc = quality["config"]
        lines += [
            "## Scores (full KV, held-out seeds)",
            "",
            f"From `python -m benchmarks.quality`, with {qc['samples']['und']} questions, {qc['samples']['t2i']} "
            f"prompts and",
            f"{qc['samples']['edit']} edits, {qc['num_timesteps']} timesteps, and otherwise the official sampling",
            "defaults:",
            "",
            "| task | headline score | chance | details |",
            "|---|---|---|---|",
        ]
        if "und" in full:
            m = full["und"]["metrics"]
            kinds = ", ".join(f"{k} {v:.2f}" for k, v in m["by_kind"].items())
            lines.append(f"| understanding | accuracy {m['accuracy']:.3f} | about 0.33 (mean over kinds) | {kinds} |")
        if "t2i" in full:
            m = full["t2i"]["metrics"]
            lines.append(
                f"| text-to-image | accuracy {m['accuracy']:.3f} (all objects right) | about 0.001 | colour "
                f"{m['color']:.2f}, shape {m['shape']:.2f}, position {m['position']:.2f}, background "
                f"{m['background']:.2f}, count {m['count']:.2f} |"
            )
        if "edit" in full:
            m = full["edit"]["metrics"]
            kinds = ", ".join(f"{k[8:]} {v:.2f}" for k, v in m.items() if k.startswith("success_"))
            lines.append(
                f"| edit | PSNR to target {m['psnr_target']:.2f} dB | source as output "
                f"{m['psnr_source_as_output']:.2f} dB | unchanged region {m['psnr_unchanged']:.2f} dB, success "
                f"{m['success']:.2f} ({kinds}) |"
            )
        lines += ["", 'The compressed-KV results are in the README, section "Quality on the bundled model".', ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=ROOT / "models" / "bagel" / "unicache-shapes")
    parser.add_argument("--quality", type=Path, default=ROOT / "out" / "quality.json")
    parser.add_argument("--note", action="append", default=[], help="a line for the Training list (repeatable)")
    args = parser.parse_args(argv)
    card_path = args.checkpoint / "README.md"
    try:  # the card is the one file of the checkpoint this writes; never --quality, a device or a weights file
        check_outputs(
            [("--checkpoint", card_path, "model card")],
            inputs=[("--quality", args.quality)],
            checkpoints=[args.checkpoint],
            allowed_names=["README.md"],
        )
    except (OSError, ValueError) as error:
        parser.error(str(error))
    training = json.loads((args.checkpoint / "training.json").read_text(encoding="utf-8"))
    quality = json.loads(args.quality.read_text(encoding="utf-8")) if args.quality.is_file() else None
    save_text(card(training, quality, args.note), card_path, "--checkpoint")
    sys.stdout.write(f"wrote {args.checkpoint / 'README.md'}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
