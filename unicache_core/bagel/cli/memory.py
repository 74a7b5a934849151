"""The command line's memory options: how the weights are stored (``--weight-dtype``) and placed (``--offload``)."""

from __future__ import annotations

import argparse

from ...cli import path_arg
from ..checkpoint.loader import OFFLOAD_MODES
from ..weights import WEIGHT_DTYPES

#: ``plan``'s image side when neither ``--width``/``--height`` nor ``--image-sizes`` gives it.
PLAN_SIDE = 1024


def _per_task(values: dict[str, float], *, percent: bool = False) -> str:
    """A per-task default of unicache_core/compression/defaults.py as argparse's help says it: ``0.2 und, 0.4 t2i,
    0.2 edit`` (``percent``: ``80%% und, ...``, escaped for argparse)."""
    names = {"understanding": "und", "t2i": "t2i", "edit": "edit"}
    form = "{:.0%}" if percent else "{:g}"
    return ", ".join(f"{form.format(values[task])} {name}" for task, name in names.items()).replace("%", "%%")


def add_kv_arguments(parser: argparse.ArgumentParser):
    """The KV-compression flags a run and its plan share (``--kv-method``, ``--kv-target``, ``--policy``, ``--rho``,
    ``--rho-floor``, ``--kv-objective``); returns their argument group."""
    from ...compression.defaults import DEFAULT_REDUCTION, RHO0, RHO_FLOOR, UNICACHE_OBJECTIVE, UNICACHE_OBJECTIVES
    from ...compression.method import METHODS

    kv = parser.add_argument_group("KV-cache compression")
    kv.add_argument("--kv-method", default="full", help=" | ".join(METHODS))
    kv.add_argument(
        "--kv-target",
        default=None,
        help="memory of the compressible KV: a retained ratio (0.2, 20%%) or a size (150MB); "
        f"default: the paper's reduction ({_per_task(DEFAULT_REDUCTION, percent=True)})",
    )
    kv.add_argument(
        "--policy",
        type=path_arg,
        default=None,
        help="unicache policy table JSON (default: the checkpoint's unicache_policy.json, else the paper's table)",
    )
    kv.add_argument("--rho", type=float, default=None, help=f"unicache rho0 in (0, 1] ({_per_task(RHO0)})")
    kv.add_argument("--rho-floor", type=float, default=None, help=f"unicache floor, <= rho ({_per_task(RHO_FLOOR)})")
    kv.add_argument(
        "--kv-objective",
        default=None,
        help=f"unicache: {' | '.join(UNICACHE_OBJECTIVES)} (default {UNICACHE_OBJECTIVE}): speed evicts the types its "
        "table evicts (fewer rows read per step); memory may keep them at low bits (least error for the bytes)",
    )
    return kv


def kv_method_of(args: argparse.Namespace):
    """The configured KV method of the flags (a one-line ValueError naming the flag for a bad value): what the run
    uses and what its plan prices."""
    from ...compression import method_from_name

    if args.policy is not None and not args.policy.is_file():
        raise ValueError(f"--policy: {args.policy} is not a file; pass a policy-table JSON file")
    given = {"rho": args.rho, "rho_floor": args.rho_floor, "policy": args.policy, "objective": args.kv_objective}
    settings = {name: value for name, value in given.items() if value is not None}
    try:
        return method_from_name(args.kv_method, kv_target=args.kv_target, **settings)
    except ValueError as exc:
        raise ValueError(f"KV flags: {exc}") from None


def add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--weight-dtype`` and ``--offload`` to ``parser``."""
    parser.add_argument(
        "--weight-dtype",
        choices=list(WEIGHT_DTYPES),
        default="auto",
        help="storage of the LLM/ViT Linear and Embedding weights, upcast to --dtype at each call: "
        "auto (= --dtype), bf16, fp16, fp32, fp8_e4m3fn, fp8_e5m2 (one scale per row) or "
        "int8 (weight-only, one scale per row); fp8/int8 halve the weights' memory",
    )
    parser.add_argument(
        "--offload",
        choices=list(OFFLOAD_MODES),
        default="none",
        help="layers: keep the decoder layers in host memory and bring each to --device as it runs",
    )


def add_plan_parser(sub) -> None:
    """The ``plan`` subcommand: the predicted peak device memory of a run, before anything is downloaded or loaded."""
    from ..memory.plan import OFFICIAL_CHECKPOINT, PLAN_TASKS
    from ..settings import T2I_DEFAULTS

    p = sub.add_parser("plan", help="predict the peak device memory of a run and whether it fits")
    p.add_argument(
        "--checkpoint",
        default=None,
        help=f"checkpoint folder, or {OFFICIAL_CHECKPOINT} for BAGEL-7B-MoT's geometry (no files needed)",
    )
    p.add_argument("--task", choices=sorted(PLAN_TASKS), required=True)
    p.add_argument(
        "--width",
        type=int,
        default=None,
        help=f"image width (und/edit: the input, t2i: the output; default {PLAN_SIDE})",
    )
    p.add_argument("--height", type=int, default=None, help=f"image height (default {PLAN_SIDE})")
    p.add_argument(
        "--image-sizes",
        default=None,
        help="the input images' sizes in request order, e.g. 1024x1024,1024x1024,768x512 (und/edit; t2i: reference "
        "images); instead of --width/--height for und and edit (an edit's output takes the last one's size)",
    )
    add_kv_arguments(p)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument(
        "--device",
        default="auto",
        help="the device whose memory is planned for ('auto': cuda if any, and with --device-memory a GPU; "
        "cpu adds the CPU runtime's own memory)",
    )
    p.add_argument("--device-memory", default=None, help="plan for a device of this size instead (e.g. 24GB)")
    p.add_argument("--json", type=path_arg, default=None, help="also write the plan as JSON here")
    p.add_argument("-q", "--quiet", action="store_true", help="no log output")
    p.add_argument("--taylorseer", action="store_true", help="t2i/edit with TaylorSeer: count its factors")
    p.add_argument(
        "--taylorseer-order",
        type=int,
        default=None,
        help=f"with --taylorseer: highest Taylor order (default {T2I_DEFAULTS.taylorseer_order}, at most 6 as a run)",
    )
    add_memory_arguments(p)


def run_plan(args: argparse.Namespace) -> int:
    """``plan``: print the plan (and write ``--json``); exit status 0 whether or not it fits."""
    import json
    import sys

    from unicache_commands.output_files import check_output_file, save_text

    if args.json is not None:  # before the plan: never a checkpoint's file, a device or a FIFO; written whole
        check_output_file("--json", args.json, "plan JSON", checkpoints=[args.checkpoint])
    images = parse_image_sizes(args.image_sizes) if args.image_sizes is not None else ()
    width, height = check_plan_request(args, images)
    plan = _plan_of(args, args.checkpoint, args.task, width, height, args.device_memory, images=images)
    sys.stdout.write(describe(plan) + "\n")
    if args.json is not None:
        save_text(json.dumps(plan.to_json(), indent=1) + "\n", args.json, "--json")
    return 0


def parse_image_sizes(value: str) -> tuple[tuple[int, int], ...]:
    """``--image-sizes "1024x1024,768x512"`` → ``((1024, 1024), (768, 512))``; a one-line ValueError names a bad
    entry."""
    import re

    sizes = []
    for index, entry in enumerate(str(value).split(",")):
        match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", entry)
        if match is None or int(match.group(1)) <= 0 or int(match.group(2)) <= 0:
            raise ValueError(
                f"--image-sizes: entry {index + 1} ({entry.strip()!r}) is not WIDTHxHEIGHT with positive sides; write "
                f"e.g. 1024x1024,768x512"
            )
        sizes.append((int(match.group(1)), int(match.group(2))))
    return tuple(sizes)


def refuse_unfitting_run(args: argparse.Namespace, checked) -> None:
    """Before a run loads anything: raise a one-line ValueError when its plan does not fit the device (several
    input images: how many of them would fit)."""
    if args.command == "t2i":
        width, height = checked.settings.width, checked.settings.height
    elif checked.image is not None:
        width, height = checked.image.size
    else:
        width = height = 0
    images: tuple[tuple[int, int], ...] = ()
    if checked.items is not None:
        from ..items import GenerateItem, ImageItem

        sizes = []
        for item in checked.items:  # a GENERATE marker's image is the size of the one before it
            if isinstance(item, ImageItem):
                sizes.append(item.image.size)
            elif isinstance(item, GenerateItem):
                sizes.append(sizes[-1] if sizes and args.command == "edit" else (width, height))
        images = tuple(sizes)
    task = {"understand": "und"}.get(args.command, args.command)
    plan = _plan_of(args, args.checkpoint, task, width, height, None, device=checked.device, images=images)
    if not plan.fits:
        raise ValueError(
            f"this run needs about {plan.peak_bytes / 1e9:.1f} GB on {checked.device} (planned), which has "
            f"{plan.device_bytes / 1e9:.1f} GB; {plan.suggestion} (details: python -m unicache_core.bagel plan)"
        )


def _plan_of(
    args, checkpoint, task: str, width: int, height: int, device_memory: str | None, *, device=None, images=()
):
    import torch

    from ..checkpoint.folder import check_folder_weights
    from ..memory.plan import (
        OFFICIAL_CHECKPOINT,
        PlanSettings,
        device_memory_bytes,
        parse_memory_size,
        plan_config,
        plan_memory,
    )
    from ..settings import BUNDLED_CHECKPOINT_DIR
    from .checks import resolve_device

    root = checkpoint if checkpoint is not None else BUNDLED_CHECKPOINT_DIR
    config = plan_config(root)
    check_plan_size(config, task, width, height)
    for index, (image_width, image_height) in enumerate(images):  # each input image as the run would read it
        try:
            check_plan_size(config, "edit", image_width, image_height)
        except ValueError as exc:
            raise ValueError(f"--image-sizes: entry {index + 1}: {str(exc).split(': ', 1)[1]}") from None
    if device is None:  # plan: the request's positions, as the run counts them (a run has checked its own)
        check_plan_positions(config, task, len(images))
    if str(root).lower() != OFFICIAL_CHECKPOINT:  # a folder: its weights' headers, where they are downloaded
        check_folder_weights(root, config, missing_ok=True)
    if device_memory is not None:  # a device that need not be here: a GPU unless --device names the CPU
        total = parse_memory_size(device_memory)
        planned = torch.device(device if device is not None else "cuda" if args.device == "auto" else args.device)
    else:
        planned = torch.device(device if device is not None else resolve_device(args.device))
        total = device_memory_bytes(planned)
    order = getattr(args, "taylorseer_order", None)
    settings = PlanSettings(
        task=task,
        width=width,
        height=height,
        kv_method=kv_method_of(args),
        checkpoint="" if str(root).lower() == OFFICIAL_CHECKPOINT else str(root),
        weight_dtype=args.weight_dtype,
        dtype=args.dtype,
        offload=args.offload,
        device=planned.type,
        images=tuple(images),
        taylorseer=bool(getattr(args, "taylorseer", False)),
        taylorseer_order=PlanSettings.taylorseer_order if order is None else order,  # 0 is an order
    )
    return plan_memory(config, settings, total)


def check_plan_request(args: argparse.Namespace, images) -> tuple[int, int]:
    """``plan``'s request, refused where the run would refuse it (its settings through the run's own checks):
    ``--taylorseer-order`` without ``--taylorseer`` or out of range, ``--taylorseer`` on an understanding, and
    ``--width``/``--height`` beside ``--image-sizes`` for und and edit (the images give the size there). Returns the
    planned ``(width, height)``."""
    from ..settings import preset
    from .checks import taylorseer_changes, with_flag

    changes = taylorseer_changes(args)
    if changes:
        try:
            preset(args.task, **changes)
        except ValueError as exc:
            raise with_flag(exc) from None
    given = [flag for flag, value in (("--width", args.width), ("--height", args.height)) if value is not None]
    if images and given and args.task != "t2i":
        raise ValueError(
            f"{given[0]}: not with --image-sizes for --task {args.task} (the input images' sizes are the ones "
            f"planned, an edit's output takes the last one's); drop {' and '.join(given)}"
        )
    return (PLAN_SIDE if args.width is None else args.width, PLAN_SIDE if args.height is None else args.height)


def check_plan_positions(config, task: str, images: int) -> None:
    """The planned request's RoPE positions (its images and a prompt of the plan's length), refused as the run
    refuses them (:func:`~..memory.accounting.check_image_positions`, naming ``--image-sizes``)."""
    from ..memory.accounting import BOUNDARY_TOKENS, PLAN_PROMPT_TOKENS, check_image_positions
    from ..settings import UNDERSTANDING_DEFAULTS

    generation = task != "und"
    used = PLAN_PROMPT_TOKENS + BOUNDARY_TOKENS + images * (2 if generation else 1) + (1 if generation else 0)
    extra = 0 if generation else UNDERSTANDING_DEFAULTS.max_new_tokens
    answer = f" and the run's default {extra}-token answer" if extra else ""
    try:
        check_image_positions(config, used, images, generation=generation, extra=extra, name="request", lowered=False)
    except ValueError as exc:
        raise ValueError(f"--image-sizes: {exc} (a plan counts a {PLAN_PROMPT_TOKENS}-token prompt{answer})") from None


def check_plan_size(config, task: str, width: int, height: int) -> None:
    """``--width``/``--height`` of a plan, refused as the run would refuse them: a text-to-image output a positive
    multiple of the latent patch within the position table (:func:`~.settings.check_output_size`); an input image
    (edit, and understanding unless both are 0 for none) at least the run's least side (2 px: a one-pixel side holds no
    picture) and at most PIL's decoding limit."""
    from PIL import Image

    from ..items import MIN_IMAGE_SIDE
    from ..settings import check_output_size

    if task == "t2i":
        try:
            check_output_size(config, width, height)
        except ValueError as exc:
            flag = "--height" if "`height`" in str(exc) else "--width"
            raise ValueError(f"{flag}: {exc} (the size of the image the run would make)") from None
        return
    if task in ("und", "understand") and width == height == 0:
        return  # an understanding request without an image
    most = Image.MAX_IMAGE_PIXELS  # PIL's decompression-bomb bound (None: PIL set to read any size)
    side = MIN_IMAGE_SIDE  # the run's own least side (items.check_image_item): a one-pixel side holds no picture
    if min(width, height) < side or (most is not None and width * height > most):
        why = " (a one-pixel side holds no picture)" if 0 < min(width, height) < side else ""
        raise ValueError(
            f"--width/--height: an input image of {width}x{height} px cannot be read by the run{why}: give its size, "
            f"at least {side}x{side} and at most {Image.MAX_IMAGE_PIXELS} pixels (0x0 plans an understanding without "
            "image)"
        )


def describe(plan) -> str:
    """The plan (:class:`~..memory.plan.MemoryPlan`) as a few human-readable lines (for the CLI's stdout)."""
    from ..memory.plan import NOT_IN_PEAK
    from ..taylorseer import GENERATION_BRANCHES, describe_factors

    gb = 1e9
    seer = f", TaylorSeer order {plan.settings.taylorseer_order}" if plan.settings.taylorseer else ""
    images = plan.settings.images
    shape = (
        f"{len(images)} images ({', '.join(_counted(f'{w}x{h}' for w, h in images))})"
        if images
        else f"{plan.settings.width}x{plan.settings.height}"
    )
    lines = [
        f"{plan.settings.task} {shape}, weights {plan.settings.weight_dtype}"
        f" (compute {plan.settings.dtype}), KV {plan.settings.kv_method}, offload {plan.settings.offload}{seer}:",
        f"  peak {plan.peak_bytes / gb:.2f} GB of {plan.device_bytes / gb:.2f} GB -> "
        + ("fits" if plan.fits else f"does not fit: {plan.suggestion}"),
    ]
    if plan.vae_decode == "tiled":
        lines.append("  the VAE decodes in tiles (the whole decode would not fit; close to it, not equal)")
    lines += [
        f"  {name:<28} {size / gb:8.3f} GB" + ("  (detail, not added)" if name in NOT_IN_PEAK else "")
        for name, size in plan.breakdown.items()
    ]
    parts = plan.breakdown
    if "kv_held" in parts:
        lines.append(
            f"  KV held at the LLM phases' peak {parts['kv_held'] / gb:.3f} GB (each image's rows once; the official "
            f"code's every branch apart: {parts['kv_full'] / gb:.3f} GB); peak phase {plan.peak_phase}"
        )
    if plan.phases:
        lines.append("  phases (GB): " + " | ".join(_phase_runs(plan.phases)))
    if "taylorseer" in plan.breakdown:
        ours, official = plan.breakdown["taylorseer"], plan.breakdown["taylorseer_official"]
        lines.append(describe_factors(ours, official, plan.settings, GENERATION_BRANCHES))
    if len(plan.kv_images) > 1:
        lines += _image_lines(plan.kv_images)
    return "\n".join(lines)


def _counted(values) -> list[str]:
    """Consecutive equal values once, with their count: ``["3 x 1024x1024", "768x512"]``."""
    runs: list[list] = []
    for value in values:
        if runs and runs[-1][0] == value:
            runs[-1][1] += 1
        else:
            runs.append([value, 1])
    return [value if count == 1 else f"{count} x {value}" for value, count in runs]


#: Runs of more per-item phases than this are printed as one range (a request of 10,000 images has 10,000).
LISTED_ITEM_PHASES = 8


def _phase_runs(phases) -> list[str]:
    """The plan's phases as ``name GB``; a long run of ``prefill:item<j>`` as one range with its least and most."""
    out: list[str] = []
    run: list[tuple[int, float]] = []

    def flush() -> None:
        if len(run) > LISTED_ITEM_PHASES:
            top = max(run, key=lambda item: item[1])
            low = min(size for _, size in run)
            out.append(f"prefill:item{run[0][0]}-{run[-1][0]} {low:.2f}..{top[1]:.2f} (most at item{top[0]})")
        else:
            out.extend(f"prefill:item{j} {size:.2f}" for j, size in run)
        run.clear()

    for name, size in phases:
        if name.startswith("prefill:item") and name[len("prefill:item") :].isdigit():
            run.append((int(name[len("prefill:item") :]), size / 1e9))
            continue
        flush()
        out.append(f"{name} {size / 1e9:.2f}")
    flush()
    return out


def _image_lines(kv_images) -> list[str]:
    """One line per run of consecutive images of equal size and KV: ``images 0-9999 1024x1024: KV ... each``."""
    gb, lines, start = 1e9, [], 0
    texts = [
        f"{image['size'][0]}x{image['size'][1]}: KV "
        + ", ".join(f"{branch} {size / gb:.3f} GB" for branch, size in image["bytes_per_branch"].items())
        + f", held {image['held_bytes'] / gb:.3f} GB"
        for image in kv_images
    ]
    for i, text in enumerate(texts):
        if i + 1 < len(texts) and texts[i + 1] == text:
            continue
        lines.append(f"  image {i} {text}" if start == i else f"  images {start}-{i} {text} each")
        start = i + 1
    return lines


__all__ = [
    "add_memory_arguments",
    "add_plan_parser",
    "check_plan_positions",
    "check_plan_request",
    "check_plan_size",
    "describe",
    "parse_image_sizes",
    "add_kv_arguments",
    "kv_method_of",
    "refuse_unfitting_run",
    "run_plan",
]
