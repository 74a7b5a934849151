"""Run with the ComfyUI host's Python: the loader node's own ModelPatcher, per ``weight_dtype``, fully and partially
loaded.

    <host python> node_patcher_check.py COMFYUI_DIR REPO CHECKPOINT_NAME

Imports the pack as ComfyUI does (a package, so ``nodes`` is the pack's and not ComfyUI's ``nodes.py``), loads
``CHECKPOINT_NAME`` from the pack's ``models/bagel`` with the loader node (``dtype`` bf16, ``device`` cpu) for
``weight_dtype`` default and fp8_e4m3fn, and for each: the operations family its layers come from, the bytes of
those layers, ``ModelPatcher.model_size()``; a text-to-image and an edit after ComfyUI's full load
(``load_models_gpu``); then the same after ``patch_model`` with a third of the model's size as
``lowvram_model_memory`` (the modules that do not fit stay behind with ``comfy_cast_weights``); and the patcher's
``model_size()`` over BAGEL-7B-MoT's geometry built on the meta device. Prints one JSON
object (the last line) for ``test_weight_dtype.py`` to check.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

PROMPT = "a large red circle at the top left and a small blue square at the center on a white background"


def main() -> None:
    comfy_dir, repo, checkpoint = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    sys.argv = [sys.argv[0], "--cpu"]
    sys.path[:0] = [str(comfy_dir), str(repo)]
    import comfy.options

    comfy.options.enable_args_parsing()
    import comfy.model_management as mm
    import numpy as np
    import torch

    spec = importlib.util.spec_from_file_location(
        "unicache_pack", repo / "__init__.py", submodule_search_locations=[str(repo)]
    )
    pack = importlib.util.module_from_spec(spec)
    sys.modules["unicache_pack"] = pack
    spec.loader.exec_module(pack)
    from unicache_pack.nodes.loader_node import UniCacheBagelLoader

    from unicache_core.bagel import BagelPipeline, preset

    t2i = preset("t2i", num_timesteps=4, width=128, height=128)
    edit = preset("edit", num_timesteps=4)

    def run(model) -> dict:
        pipe = BagelPipeline(model.runtime())
        image = pipe.text_to_image(PROMPT, t2i, seed=3).image
        edited = pipe.edit("change the background to black", image, edit, seed=3).image
        return {"t2i": np.asarray(image, dtype=np.int16), "edit": np.asarray(edited, dtype=np.int16)}

    def compare(got: dict, want: dict) -> dict:
        return {
            k: {
                "equal": bool(np.array_equal(got[k], want[k])),
                "max_abs": int(np.abs(got[k] - want[k]).max()),
                "shape": list(got[k].shape),
            }
            for k in want
        }

    report = {}
    outputs = {}
    for weight_dtype in ("default", "fp8_e4m3fn"):
        (model,) = UniCacheBagelLoader.execute(checkpoint, "bf16", "cpu", weight_dtype=weight_dtype).args
        patcher, modules = model.patcher, model.patcher.model
        castable = [m for m in modules.modules() if hasattr(m, "comfy_cast_weights")]
        up = model.loaded.model.language_model.model.layers[0].mlp.up_proj
        entry = {
            "operations": type(up).__qualname__.split(".")[0],
            "up_proj_dtype": str(up.weight.dtype),
            "vae_conv_dtype": str(modules.vae.decoder.conv_in.weight.dtype),
            "castable_modules": len(castable),
            "castable_bytes": sum(t.numel() * t.element_size() for m in castable for t in m.parameters(recurse=False)),
            "model_size": patcher.model_size(),
        }
        mm.load_models_gpu([patcher], memory_required=1 << 20)  # the task nodes' call: a full load on a CPU host
        full = run(model)
        mm.unload_all_models()
        budget = patcher.model_size() // 3
        patcher.patch_model(device_to=torch.device("cpu"), lowvram_model_memory=budget)
        left = [m for m in castable if m.comfy_cast_weights and hasattr(m, "prev_comfy_cast_weights")]
        entry["partial"] = {
            "budget": budget,
            "lowvram": bool(modules.model_lowvram),
            "left_with_comfy_cast_weights": len(left),
            "loaded_bytes": patcher.loaded_size(),
            "execution_device": str(model.loaded.model.device),
            "vs_full_load": compare(run(model), full),
        }
        patcher.unpatch_model(device_to=torch.device("cpu"))
        outputs[weight_dtype] = full
        report[weight_dtype] = entry
    report["fp8_vs_default"] = compare(outputs["fp8_e4m3fn"], outputs["default"])
    report["real_geometry_model_size"] = real_geometry_model_sizes()
    print(json.dumps(report))


def real_geometry_model_sizes() -> dict:
    """``model_size()`` of the node's patcher over BAGEL-7B-MoT's geometry (built on the meta device, no files)
    per weight dtype: the bytes ComfyUI plans with."""
    from types import SimpleNamespace

    import torch
    from unicache_pack.nodes import host
    from unicache_pack.nodes.model import BagelModules

    from unicache_core.bagel.memory.plan import official_config
    from unicache_core.bagel.modeling import AutoEncoder
    from unicache_core.bagel.weights import build_bagel

    config, cpu = official_config(), torch.device("cpu")
    sizes = {}
    for weight_dtype in ("default", "fp8_e4m3fn"):
        picked = host.host_operations(weight_dtype, "bf16", cpu)
        model = build_bagel(
            config, weight_dtype=picked.weight_dtype, dtype=torch.bfloat16, device="meta", operations=picked.operations
        )
        vae = AutoEncoder(config.ae, operations=picked.operations, dtype=torch.float32, device="meta")
        modules = BagelModules(SimpleNamespace(model=model, vae=vae, device=cpu, dtype=torch.bfloat16))
        sizes[weight_dtype] = host.make_patcher(modules, cpu, cpu).model_size()
    return sizes


if __name__ == "__main__":
    main()
