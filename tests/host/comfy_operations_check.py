"""Run with the ComfyUI host's Python: BAGEL built from ``comfy.ops`` layers, loaded, and partially loaded.

    <host python> comfy_operations_check.py COMFYUI_DIR REPO CHECKPOINT

Builds the checkpoint's model (and VAE) from ``comfy.ops.disable_weight_init``, ``comfy.ops.manual_cast``
and ``comfy.ops.pick_operations(fp8_e4m3fn, bf16)`` (on a CPU host: ``manual_cast`` with fp8 storage), loads
the weights as ComfyUI does (``load_state_dict`` into the built tensors, cast to their dtype) and runs every
path (text prefill, a mixed und/gen latent block, logits, velocity, ViT, VAE encode and decode) against the
default build, and the same build made on the meta device and filled tensor by tensor with
``assign_checkpoint_tensor`` (a streaming loader's path) against it. Then wraps a build in a ``ModelPatcher`` and loads
it with a small ``lowvram_model_memory``: the modules that do not fit stay behind with ``comfy_cast_weights`` and fetch
their weights per call. Prints one JSON object (the last line) for ``test_comfy_operations.py`` to check.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    comfy_dir, repo, checkpoint = (Path(a) for a in sys.argv[1:4])
    sys.argv = [sys.argv[0], "--cpu"]
    sys.path[:0] = [str(comfy_dir), str(repo)]
    import comfy.options

    comfy.options.enable_args_parsing()
    import comfy.model_management
    import comfy.model_patcher
    import comfy.ops
    import torch
    from safetensors.torch import load_file

    from unicache_core.bagel.config import load_bagel_config
    from unicache_core.bagel.modeling import AutoEncoder, Bagel
    from unicache_core.bagel.weights import assign_checkpoint_tensor, checkpoint_shapes
    from unicache_core.kv.cache import AttentionCall, FullKVCache
    from unicache_core.kv.token_types import TokenType, type_tensor

    cfg = load_bagel_config(checkpoint)
    ema = load_file(str(checkpoint / "ema.safetensors"))
    ae = load_file(str(checkpoint / "ae.safetensors"))

    def build(operations, dtype, compute_dtype=None):
        model = Bagel(cfg, operations=operations, dtype=dtype, compute_dtype=compute_dtype)
        model.load_state_dict(ema)
        vae = AutoEncoder(cfg.ae, operations=operations, dtype=torch.float32)
        vae.load_state_dict(ae)
        return model.requires_grad_(False).eval(), vae.requires_grad_(False).eval()

    def call(n, pos, causal, update):
        return AttentionCall(
            token_types=type_tensor(TokenType.INSTRUCTION, n), rope_positions=pos, causal=causal, update=update
        )

    @torch.inference_mode()
    def outputs(model, vae):
        gen = torch.Generator().manual_seed(0)
        cache = FullKVCache(model.num_layers)
        ids, pos = torch.arange(2, 14), torch.arange(12)
        text = model.forward_llm(model.embed_text(ids), pos, cache, call(12, pos, True, True))
        lat = model.embed_latents(torch.randn(4, 64, generator=gen), model.latent_position_ids(2, 2), 0.6)
        block = torch.cat([model.embed_text(torch.tensor([1])), lat, model.embed_text(torch.tensor([2]))])
        bpos = torch.full((6,), 12)
        hidden = model.forward_llm(
            block, bpos, cache, call(6, bpos, False, False), torch.tensor([False, True, True, True, True, False])
        )
        image = torch.rand(3, 28, 28, generator=gen) * 2 - 1
        z = vae.encode(image[None, :, :24, :24], generator=torch.Generator().manual_seed(1))
        return {
            "logits": model.lm_logits(text),
            "velocity": model.latent_velocity(hidden[1:-1]),
            "vit": model.embed_vit(image),
            "latent": z,
            "pixels": vae.decode(z),
        }

    def compare(got, want):
        return {
            k: {
                "equal": bool(torch.equal(got[k], want[k])),
                "relative_error": float((got[k].float() - want[k].float()).norm() / want[k].float().norm()),
            }
            for k in want
        }

    bf16 = torch.bfloat16
    reference = outputs(*build(None, bf16))
    fp8_ops = comfy.ops.pick_operations(torch.float8_e4m3fn, bf16, load_device=torch.device("cpu"))
    builds = {
        "disable_weight_init": (comfy.ops.disable_weight_init, bf16, None),
        "manual_cast": (comfy.ops.manual_cast, bf16, None),
        "manual_cast_fp32_storage": (comfy.ops.manual_cast, torch.float32, bf16),
        "pick_operations_fp8_e4m3fn": (fp8_ops, torch.float8_e4m3fn, bf16),
    }
    report = {"picked_for_fp8": fp8_ops.__name__, "builds": {}}
    for name, (ops, dtype, compute) in builds.items():
        model, vae = build(ops, dtype, compute)
        up = model.language_model.model.layers[0].mlp.up_proj
        report["builds"][name] = {
            "up_proj_dtype": str(up.weight.dtype),
            "has_comfy_cast_weights": hasattr(up, "comfy_cast_weights"),
            "vs_default": compare(outputs(model, vae), reference),
        }
        # the streaming path a loader takes: built on meta, each tensor converted and placed as it is read
        streamed = Bagel(cfg, operations=ops, dtype=dtype, compute_dtype=compute, device="meta")
        assert set(checkpoint_shapes(streamed)) == set(ema)
        for key, tensor in ema.items():
            assign_checkpoint_tensor(streamed, key, tensor)
        streamed.reset_buffers("cpu")
        report["builds"][name]["streamed_vs_load_state_dict"] = compare(
            outputs(streamed.eval(), vae), outputs(model, vae)
        )

    class Modules(torch.nn.Module):
        """BAGEL and its VAE in one module with a plain ``device`` attribute, as the pack's loader wraps them."""

        def __init__(self, model, vae):
            super().__init__()
            self.bagel, self.vae = model, vae
            self.device = torch.device("cpu")

    sizes = {}
    for name in ("disable_weight_init", "pick_operations_fp8_e4m3fn"):
        ops, dtype, compute = builds[name]
        wrapper = Modules(*build(ops, dtype, compute))
        patcher = comfy.model_patcher.ModelPatcher(
            wrapper, load_device=torch.device("cpu"), offload_device=torch.device("cpu")
        )
        sizes[name] = {
            "model_size": patcher.model_size(),
            "operations_layer_bytes": sum(
                t.numel() * t.element_size()
                for m in wrapper.bagel.modules()
                if hasattr(m, "comfy_cast_weights")
                for t in m.parameters(recurse=False)
            ),
        }
        full = outputs(wrapper.bagel, wrapper.vae)
        budget = patcher.model_size() // 3
        patcher.patch_model(device_to=torch.device("cpu"), lowvram_model_memory=budget)
        castable = [m for m in wrapper.modules() if hasattr(m, "comfy_cast_weights")]
        left = [m for m in castable if m.comfy_cast_weights and hasattr(m, "prev_comfy_cast_weights")]
        loaded = [m for m in castable if getattr(m, "comfy_patched_weights", False)]
        partial = outputs(wrapper.bagel, wrapper.vae)
        report[f"partial_{name}"] = {
            "budget": budget,
            "model_size": patcher.model_size(),
            "lowvram": bool(wrapper.model_lowvram),
            "castable_modules": len(castable),
            "left_with_comfy_cast_weights": len(left),
            "loaded_modules": len(loaded),
            "loaded_bytes": patcher.loaded_size(),
            "vs_full_load": compare(partial, full),
        }
        patcher.unpatch_model(device_to=torch.device("cpu"))
    report["model_size"] = sizes
    print(json.dumps(report))


if __name__ == "__main__":
    main()
