"""BAGEL-7B-MoT's real geometry with random weights, written in fp8 and run through the streaming loader.

``python -m benchmarks.real_size [--out DIR] [--weight-dtype int8] [--json PATH]``

The checkpoint folder (``out/real_size`` by default, ignored by git) gets the official LLM/ViT configs
(:data:`~unicache_core.bagel.checkpoint.single_file.OFFICIAL_LLM_CONFIG`: 28 layers, hidden 3584, 28/4 heads,
MLP 18944, vocab 152,064, both experts; SigLIP 27 layers of 1152), the real FLUX VAE (fp32, random), the tiny
tokenizer with BAGEL's special tokens at their real ids and a ``transform_config.json`` that edits a 256 px source
at 256 px (:func:`write_edit_transforms`). ``ema.safetensors`` is written tensor by tensor in
``float8_e4m3fn`` (N(0, 0.02) weights, unit norms, zero biases): the header first, then each tensor generated,
converted and appended, so the process never holds more than one tensor (14.6 GB on disk). The run then loads
it with ``--weight-dtype`` (int8 by default: CPU decoding reads int8 weights directly), runs a 256 px edit
(3 timesteps = 2 denoising steps, CFG on) and a 4-token understanding answer with ``full`` and ``unicache``, and
reports the peak RSS of the whole process, the load seconds, the seconds of each denoising step (the first
includes building the contexts; ``seconds_per_step`` is the median of the others), the KV bytes per branch and
the attention share of the steps (the caches' attention time over the steps' time).

:func:`run` with ``llm=``/``vit=`` overrides runs the same code path at tiny dimensions (the unit test).
"""

from __future__ import annotations

import json
import logging
import statistics
import struct
import sys
import time
from pathlib import Path

import torch
from PIL import Image

from benchmarks.report_file import check_report_paths, write_json_report
from benchmarks.rss import peak_rss_bytes
from training.tiny import write_tiny_checkpoint
from unicache_commands.flags import OneLineParser, path_arg
from unicache_core.bagel import BagelPipeline, load_bagel, preset
from unicache_core.bagel.checkpoint.single_file import OFFICIAL_LLM_CONFIG, OFFICIAL_VIT_CONFIG
from unicache_core.bagel.config import bagel_config_from_dicts
from unicache_core.bagel.request import RunHooks
from unicache_core.bagel.transform_config import TRANSFORM_CONFIG_FILE
from unicache_core.bagel.weights import build_bagel, checkpoint_shapes
from unicache_core.compression import make_cache_factory

logger = logging.getLogger("benchmarks.real_size")
REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "out" / "real_size"
#: The dtype the weights are written in, and its safetensors name.
DISK_DTYPE, DISK_DTYPE_NAME = torch.float8_e4m3fn, "F8_E4M3"
WEIGHT_STD = 0.02
#: Values generated at once while writing a tensor (bounds the writer's memory).
CHUNK_VALUES = 1 << 24
SOURCE_SIZE = 256
TIMESTEPS = 3
ANSWER_TOKENS = 4


def _fill(name: str, shape: tuple[int, ...], generator: torch.Generator):
    """The chunks (fp32, row-major) of a random tensor ``name``: unit norm weights, zero biases, N(0, 0.02) else."""
    total = 1
    for size in shape:
        total *= size
    for start in range(0, total, CHUNK_VALUES):
        count = min(CHUNK_VALUES, total - start)
        if len(shape) == 1 and "norm" in name and name.endswith("weight"):
            yield torch.ones(count)
        elif len(shape) == 1 and name.endswith("bias"):
            yield torch.zeros(count)
        else:
            yield torch.randn(count, generator=generator) * WEIGHT_STD


def write_streamed_weights(path: Path, shapes: dict[str, tuple[int, ...]], *, seed: int = 0) -> int:
    """Write a safetensors file of random ``shapes`` in :data:`DISK_DTYPE`, one chunk at a time; returns its bytes."""
    element = torch.empty((), dtype=DISK_DTYPE).element_size()
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in sorted(shapes):
        size = element
        for dim in shapes[name]:
            size *= dim
        header[name] = {"dtype": DISK_DTYPE_NAME, "shape": list(shapes[name]), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    generator = torch.Generator().manual_seed(seed)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)))
        out.write(text)
        for name in sorted(shapes):
            for chunk in _fill(name, shapes[name], generator):
                out.write(chunk.to(DISK_DTYPE).view(torch.uint8).numpy().tobytes())
    return 8 + len(text) + offset


def edit_transform_rules(source_size: int = SOURCE_SIZE) -> dict:
    """The official ViT rule and a VAE rule that keeps a ``source_size`` source at its size (the official VAE rule
    would take a 256 px source to 512 px), so the edit runs at ``source_size`` px."""
    return {
        "vae": {"max_size": source_size, "min_size": source_size // 2, "stride": 16},
        "vit": {"max_size": 980, "min_size": 224, "stride": 14},
    }


def write_edit_transforms(out: Path, source_size: int = SOURCE_SIZE) -> None:
    """``transform_config.json`` of :func:`edit_transform_rules` in ``out``."""
    rules = edit_transform_rules(source_size)
    (out / TRANSFORM_CONFIG_FILE).write_text(json.dumps(rules, indent=1) + "\n", encoding="utf-8")


def write_real_size_checkpoint(
    out: Path,
    *,
    llm: dict | None = None,
    vit: dict | None = None,
    full_vae: bool = True,
    source_size: int = SOURCE_SIZE,
) -> Path:
    """The folder described in the module docstring (``llm``/``vit``: config overrides for a smaller twin;
    ``source_size``: the edit size its transform rule keeps)."""
    llm_config = {**OFFICIAL_LLM_CONFIG, **(llm or {})}
    vit_config = {**OFFICIAL_VIT_CONFIG, **(vit or {})}
    marker = out / "real_size.json"
    wanted = {"llm": llm_config, "vit": vit_config, "full_vae": full_vae, "version": 1}
    if marker.is_file() and json.loads(marker.read_text()) == wanted:
        write_edit_transforms(out, source_size)  # a folder written before the file existed gets it too
        return out
    write_tiny_checkpoint(out, force=True, full_vocab=llm_config["vocab_size"] >= 151654, full_vae=full_vae)
    write_edit_transforms(out, source_size)
    for file_name, config in (("llm_config.json", llm_config), ("vit_config.json", vit_config)):
        (out / file_name).write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    config = bagel_config_from_dicts(llm_config, vit_config, source=str(out))
    shapes = {name: tuple(shape) for name, shape in checkpoint_shapes(build_bagel(config, device="meta")).items()}
    written = write_streamed_weights(out / "ema.safetensors", shapes)
    marker.write_text(json.dumps(wanted) + "\n")
    logger.info("wrote %s (%.2f GB of weights)", out, written / 1e9)
    return out


def _timed_edit(pipe: BagelPipeline) -> tuple[list[float], dict]:
    marks: list[float] = []
    start = time.perf_counter()
    image = Image.new("RGB", (SOURCE_SIZE, SOURCE_SIZE), (40, 120, 200))
    result = pipe.edit(
        "make the background red",
        image,
        preset("edit", num_timesteps=TIMESTEPS),
        hooks=RunHooks(progress=lambda done, total: marks.append(time.perf_counter())),
    )
    steps = [b - a for a, b in zip([start] + marks, marks)][-(TIMESTEPS - 1) :]
    return steps, result


def run(
    out: Path, *, weight_dtype: str = "int8", llm: dict | None = None, vit: dict | None = None, full_vae: bool = True
) -> dict:
    """Write (if needed), load and run; returns the report (see the module docstring)."""
    checkpoint = write_real_size_checkpoint(out, llm=llm, vit=vit, full_vae=full_vae)
    start = time.perf_counter()
    loaded = load_bagel(checkpoint, weight_dtype=weight_dtype)
    report: dict = {
        "weight_dtype": weight_dtype,
        "load_seconds": round(time.perf_counter() - start, 2),
        "file_bytes": (checkpoint / "ema.safetensors").stat().st_size,
        "runs": [],
    }
    for kv_method in ("full", "unicache"):
        pipe = BagelPipeline(loaded, make_cache_factory(kv_method, checkpoint_dir=str(checkpoint)))
        steps, result = _timed_edit(pipe)
        attention = [s.get("attention_s") or 0.0 for s in result.kv_report.get("steps", [])][-len(steps) :]
        start = time.perf_counter()
        answer = pipe.understand(
            "What is in the image?",
            Image.new("RGB", (SOURCE_SIZE, SOURCE_SIZE), (9, 9, 9)),
            preset("understanding", max_new_tokens=ANSWER_TOKENS),
        )
        report["runs"].append(
            {
                "kv_method": kv_method,
                "edit_size": list(result.image.size),
                "edit_step_seconds": [round(s, 3) for s in steps],
                "seconds_per_step": round(statistics.median(steps[1:] or steps), 3),
                "edit_kv_bytes_per_branch": result.info["cache_bytes"],
                "attention_share_of_step": round(sum(attention) / sum(steps), 4) if steps and attention else None,
                "und_seconds": round(time.perf_counter() - start, 2),
                "und_kv_bytes": answer.info["cache_bytes"],
            }
        )
        logger.info("%s", report["runs"][-1])
    report["peak_rss_bytes"] = peak_rss_bytes()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m benchmarks.real_size", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="checkpoint folder (about 15 GB)")
    parser.add_argument("--weight-dtype", default="int8", choices=("int8", "fp8_e4m3fn", "fp8_e5m2"))
    parser.add_argument("--json", type=path_arg, default=None)
    args = parser.parse_args(argv)
    check_report_paths(parser, [("--json", args.json, "JSON report")], checkpoints=[args.out])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    start = time.perf_counter()
    report = run(args.out, weight_dtype=args.weight_dtype)
    report["seconds"] = round(time.perf_counter() - start, 1)
    sys.stdout.write(json.dumps(report, indent=1) + "\n")
    if args.json is not None:
        write_json_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
