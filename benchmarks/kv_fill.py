"""Bytes held while the context fills: KV and tensor peaks of each prefill call and phase, full KV against UniCache.

``python -m benchmarks.kv_fill [--checkpoint DIR] [--images 1,2] [--methods full,unicache] [--label NAME]
[--json PATH]`` edits ``N`` sources (128 px, 3 timesteps) on a checkpoint (default: the bundled shapes model) and
records, with tensor accounting (:class:`~unicache_core.bagel.memory_trace.TensorMemoryTracker`; the weights, loaded
before, are not counted):

- per prefill call (each image's VAE and ViT block, each text): the branch, the image, the KV the session holds after
  it (storages shared by branches counted once) and the tensor peak inside the call;
- per phase of :attr:`~unicache_core.bagel.request.RunHooks.phase` (``contexts``: VAE encode and prefill; ``denoise``;
  ``decode``): the tensor peak (activations included);
- the KV held at the request's peak and after its last step (the KV report's ``peak_bytes`` and last ``held_bytes``).

It only uses what the engine had before compress-as-you-fill, so the same file measures an older checkout
(``PYTHONPATH=<checkout> python benchmarks/kv_fill.py --label main``) beside this one; ``--json`` adds its rows to
the file's (rows of the same label are replaced). Deterministic bytes, not timings (docs/compression.md §13).
"""

from __future__ import annotations

import logging
import sys

import numpy as np
import torch
from PIL import Image

from benchmarks.report_file import check_report_paths, write_json_report
from unicache_commands.flags import OneLineParser, path_arg
from unicache_commands.input_files import parse_json, read_text_file
from unicache_core.bagel import BagelPipeline, RunHooks, load_bagel, preset
from unicache_core.bagel.memory_trace import TensorMemoryTracker
from unicache_core.bagel.settings import BUNDLED_CHECKPOINT_DIR
from unicache_core.compression import make_cache_factory
from unicache_core.compression.compressing_cache import CompressingKVCache
from unicache_core.compression.full_cache import ReportingFullKVCache

logger = logging.getLogger("benchmarks.kv_fill")


def _image(seed: int, size: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8))


def measure(loaded, checkpoint: str, method: str, images: int, size: int = 128) -> dict:
    """One edit's bytes (module docstring)."""
    tracker = TensorMemoryTracker()
    calls: list[dict] = []
    phases: dict[str, int] = {}
    current: list[str] = []
    patched = {}
    for cls in (ReportingFullKVCache, CompressingKVCache):
        begin_call, end_call = cls.begin_call, cls.end_call

        def begin(self, call, begin_call=begin_call):
            if call.phase == "prefill":
                tracker.reset_peak()
            begin_call(self, call)

        def end(self, call, end_call=end_call):
            end_call(self, call)
            if call.phase == "prefill":
                item = "text" if call.image is None else f"image{call.image}"
                held = self.coordinator.held_bytes()
                calls.append({"branch": self.branch, "item": item, "kv_held": held, "peak": tracker.peak_bytes})

        patched[cls] = (begin_call, end_call)
        cls.begin_call, cls.end_call = begin, end  # type: ignore[method-assign]

    def phase(name: str) -> None:
        if current:
            phases[current[-1]] = max(phases.get(current[-1], 0), tracker.peak_bytes)
        tracker.reset_peak()
        current.append(name)

    try:
        pipe = BagelPipeline(loaded, make_cache_factory(method, checkpoint_dir=checkpoint))
        items = [_image(10 + i, size) for i in range(images)] + ["make the circle blue"]
        with tracker:
            result = pipe.generate("edit", items, preset("edit", num_timesteps=3), seed=1, hooks=RunHooks(phase=phase))
            phase("end")
    finally:
        for cls, (begin_call, end_call) in patched.items():
            cls.begin_call, cls.end_call = begin_call, end_call  # type: ignore[method-assign]
    report = result.kv_report
    steps = report["steps"]
    return {
        "method": method,
        "images": images,
        "prefill_calls": calls,
        "kv_after_prefill": calls[-1]["kv_held"],
        "phase_peaks": {name: phases[name] for name in current if name in phases},
        "kv_peak": report["summary"]["peak_bytes"],
        "kv_after_first_step": steps[0]["held_bytes"],
        "kv_steady": steps[-1]["held_bytes"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(prog="python -m benchmarks.kv_fill", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=path_arg, default=BUNDLED_CHECKPOINT_DIR)
    parser.add_argument("--images", default="1,2")
    parser.add_argument("--methods", default="full,unicache")
    parser.add_argument("--label", default="this checkout")
    parser.add_argument("--json", type=path_arg, default=None, help="add this run's rows to this JSON report")
    args = parser.parse_args(argv)
    check_report_paths(parser, [("--json", args.json, "JSON report")], checkpoints=[args.checkpoint])
    old: dict = {"rows": []}
    if args.json is not None and args.json.exists():  # the rows of other labels stay (main's beside a branch's)
        text = read_text_file(args.json, label="--json", max_bytes=64 << 20, advice="give a new --json path")
        previous = parse_json(text, label=f"--json {args.json}")
        if not isinstance(previous, dict) or not isinstance(previous.get("rows"), list):
            parser.error(f"--json: {args.json} is not a report of this program (no 'rows' list); give a new path")
        old = previous
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    loaded = load_bagel(args.checkpoint, dtype=torch.float32)
    rows = []
    for method in args.methods.split(","):
        for n in (int(x) for x in args.images.split(",")):
            row = {"label": args.label, "checkpoint": args.checkpoint.name}
            row.update(measure(loaded, str(args.checkpoint), method, n))
            rows.append(row)
            sys.stdout.write(
                f"{args.label:14} {method:9} {n} img: KV after prefill {row['kv_after_prefill']:>9,} B, "
                f"at peak {row['kv_peak']:>9,}, after step 1 {row['kv_after_first_step']:>9,}, steady "
                f"{row['kv_steady']:>9,}; prefill-call peak {max(c['peak'] for c in row['prefill_calls']):>11,}; "
                + ", ".join(f"{k} {v:,}" for k, v in row["phase_peaks"].items())
                + "\n"
            )
    if args.json is not None:
        keep = [r for r in old["rows"] if not (r["label"] == args.label and r["checkpoint"] == args.checkpoint.name)]
        write_json_report(args.json, {"rows": keep + rows})


if __name__ == "__main__":
    main()
