"""Node-level tests of the ComfyUI pack without a ComfyUI host (ComfyUI modules stubbed: tests/comfy_stubs.py).

- every node: a ComfyUI V3 node (``io.ComfyNode``, listed by the pack's ``comfy_entrypoint``); tooltip on every
  input, bounds on every number, defaults within them;
  DESCRIPTION and a ``UniCache/...`` CATEGORY (the shipped workflows: test_workflows.py);
- the loader lists folders, caches the model; a task node runs end to end on the tiny checkpoint; the report
  node returns an IMAGE and the web chart's ``ui`` payload; interrupts become ComfyUI's exception.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import sys
from pathlib import Path

import pytest
import torch
from comfy_stubs import TINY_NAME, Interrupt, NodeCall, fresh_model_cache, host_stubs  # noqa: F401  (host_stubs, fresh_model_cache: fixtures)
from test_safetensors_sniff import resave_with_low_byte

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", autouse=True)
def _fresh_model_cache(fresh_model_cache):
    """The nodes' model cache emptied around this module (tests/comfy_stubs.py)."""


@pytest.fixture(scope="module")
def pack():
    """The pack imported the way ComfyUI does: the repo root as a package with relative imports."""
    spec = importlib.util.spec_from_file_location(
        "unicache_pack_under_test", ROOT / "__init__.py", submodule_search_locations=[str(ROOT)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        for name in [n for n in sys.modules if n == spec.name or n.startswith(spec.name + ".")]:
            del sys.modules[name]


def _mappings():
    import nodes

    return nodes.NODE_CLASS_MAPPINGS


# ------------------------------------------------------------------------------------ node declarations


def test_pack_entry_exports(pack):
    import asyncio

    from comfy_api.latest import ComfyExtension, io

    assert not hasattr(pack, "NODE_CLASS_MAPPINGS")  # ComfyUI would load V1 mappings instead of the entry point
    extension = asyncio.run(pack.comfy_entrypoint())
    assert isinstance(extension, ComfyExtension)
    classes = asyncio.run(extension.get_node_list())
    assert all(issubclass(cls, io.ComfyNode) for cls in classes)
    ids = {cls.define_schema().node_id: cls.define_schema().display_name for cls in classes}
    assert ids == pack.nodes.NODE_DISPLAY_NAME_MAPPINGS
    assert set(ids) == {
        "UniCacheBagelLoader",
        "UniCacheKVConfig",
        "UniCacheTextToImage",
        "UniCacheImageEdit",
        "UniCacheUnderstand",
        "UniCacheKVReport",
        "UniCacheImageItem",
        "UniCacheTextItem",
    }
    assert pack.WEB_DIRECTORY == "./web" and (ROOT / "web" / "unicache.js").is_file()


@pytest.mark.parametrize(
    "node_id",
    sorted(
        [
            "UniCacheBagelLoader",
            "UniCacheKVConfig",
            "UniCacheTextToImage",
            "UniCacheImageEdit",
            "UniCacheUnderstand",
            "UniCacheKVReport",
        ]
    ),
)
def test_declarations(node_id):
    cls = _mappings()[node_id]
    schema = cls.define_schema()
    assert schema.node_id == node_id
    ids = [i.id for i in schema.inputs] + [o.id for o in schema.outputs]
    assert len(ids) == len(set(ids)), f"{node_id}: V3 wants input and output ids distinct"
    spec = cls.INPUT_TYPES()
    params = inspect.signature(cls.execute).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):  # else: the shared run helper
        required, optional = list(spec.get("required", {})), list(spec.get("optional", {}))
        assert list(params) == required + optional, node_id
        for name in optional:
            assert params[name].default is not inspect.Parameter.empty, f"{node_id}.{name}: optional, no default"
    assert cls.CATEGORY.startswith("UniCache/") and len(cls.DESCRIPTION) > 40
    assert len(cls.RETURN_TYPES) == len(cls.RETURN_NAMES) == len(cls.OUTPUT_TOOLTIPS)
    for section in ("required", "optional"):
        for name, (kind, *rest) in spec.get(section, {}).items():
            opts = rest[0] if rest else {}
            assert opts.get("tooltip"), f"{node_id}.{name} has no tooltip"
            if kind in ("INT", "FLOAT"):
                assert {"min", "max", "step"} <= set(opts), f"{node_id}.{name} lacks min/max/step"
                assert opts["min"] <= opts["default"] <= opts["max"]
            if kind == "COMBO":
                assert opts.get("default", opts["options"][0]) in opts["options"]


def test_kv_config_tooltips_give_the_defaults_of_defaults_py():
    from unicache_core.compression.defaults import RHO0, RHO_FLOOR

    spec = _mappings()["UniCacheKVConfig"].INPUT_TYPES()["required"]
    rho_tip, floor_tip = spec["rho"][1]["tooltip"], spec["rho_floor"][1]["tooltip"]
    assert f"{RHO0['t2i']:g} text-to-image" in rho_tip and f"{RHO0['edit']:g} edit" in rho_tip
    assert f"{RHO_FLOOR['t2i']:g} text-to-image" in floor_tip and f"{RHO_FLOOR['edit']:g} edit" in floor_tip
    assert "0.5" not in rho_tip  # the number the tooltip once gave, never a default


def test_kv_config_node_builds_configs():
    from unicache_core.compression import UniCache

    node = NodeCall(_mappings()["UniCacheKVConfig"])
    (cfg,) = node.build("unicache", 0.0, 0.0, -1.0, "default", 128)
    assert cfg == UniCache(score_queries=128)
    (cfg,) = node.build("unicache", 0.0, 0.4, 0.0, "default")
    assert (cfg.kv_target, cfg.rho, cfg.rho_floor) == (None, 0.4, 0.0)
    (cfg,) = node.build("unicache", 0.3, 0.0, -1.0, "default")
    assert (cfg.kv_target, cfg.rho, cfg.rho_floor) == (0.3, None, None)
    (cfg,) = node.build("h2o", 0.2, 0.0, -1.0, "default")  # the unicache-only widgets unset
    assert (cfg.name, cfg.kv_target) == ("h2o", 0.2) and not hasattr(cfg, "rho")
    with pytest.raises(ValueError, match="rho_floor"):
        node.build("unicache", 0.0, 0.2, 0.5, "default")


# --------------------------------------------------------------------------------- loader and run


def _load(host_stubs):
    import nodes

    loader = nodes.NODE_CLASS_MAPPINGS["UniCacheBagelLoader"]
    choices = loader.INPUT_TYPES()["required"]["checkpoint"][1]["options"]
    assert TINY_NAME in choices
    (model,) = NodeCall(loader)(TINY_NAME, "fp32", "auto")
    return model


def test_loader_lists_caches_and_explains(host_stubs, tmp_path):
    import nodes
    from nodes.model import NO_CHECKPOINT

    fp = host_stubs["folder_paths"]
    model = _load(host_stubs)
    assert str(host_stubs["folder_paths"].models_dir) in fp.get_folder_paths("bagel")[0]
    assert model.patcher.model.bagel is model.loaded.model and model.patcher.size > 0
    (again,) = NodeCall(nodes.NODE_CLASS_MAPPINGS["UniCacheBagelLoader"]).load(TINY_NAME, "fp32", "auto")
    assert again is model  # reused, never re-read
    with pytest.raises(FileNotFoundError, match="models/bagel|bagel model folders"):
        NodeCall(nodes.NODE_CLASS_MAPPINGS["UniCacheBagelLoader"]).load(NO_CHECKPOINT, "fp32", "auto")
    with pytest.raises(FileNotFoundError, match="refresh"):
        NodeCall(nodes.NODE_CLASS_MAPPINGS["UniCacheBagelLoader"]).load("missing-model", "fp32", "auto")
    policies = nodes.NODE_CLASS_MAPPINGS["UniCacheKVConfig"].INPUT_TYPES()["required"]["policy"][1]["options"]
    assert policies[0] == "default" and "bagel-7b-mot.json" in policies


def test_text_to_image_end_to_end(host_stubs):
    import nodes
    from unicache_core.compression import UniCache

    model = _load(host_stubs)
    node = NodeCall(nodes.NODE_CLASS_MAPPINGS["UniCacheTextToImage"])
    image, latent, thinking, report = node.generate(
        model, "a red cube", 64, 48, 3, 7, 4.0, 1.5, 0.4, 1.0, 3.0, 0.0, "global", False, kv=UniCache()
    )
    assert image.shape == (1, 48, 64, 3) and image.dtype == torch.float32
    assert 0.0 <= image.min() and image.max() <= 1.0
    assert latent["samples"].shape == (1, 16, 6, 8)
    assert thinking == "" and report["format"] == "unicache-kv-report" and report["method"] == "unicache"
    mm = host_stubs["comfy.model_management"]
    # ComfyUI decides how much of the model to load (no forced full load: lowvram partial loading applies)
    assert mm.loads and mm.loads[-1][0] == [model.patcher] and mm.loads[-1][1] > 0 and not mm.loads[-1][2]
    assert host_stubs["comfy.utils"].progress[-1] == (2, 2)

    out = NodeCall(nodes.NODE_CLASS_MAPPINGS["UniCacheKVReport"]).show(report)
    plot, summary = out["result"]
    assert plot.ndim == 4 and plot.shape[0] == 1 and plot.shape[-1] == 3 and 0 <= plot.min() and plot.max() <= 1
    assert "unicache" in summary
    chart = out["ui"]["unicache_kv"][0]
    json.dumps(out["ui"])
    assert chart["full_bytes"] > 0 and set(chart["series"]) >= {"gen"} and chart["series"]["gen"]["rho"]


def test_edit_batch_and_understand(host_stubs):
    import nodes

    model = _load(host_stubs)
    gen = torch.Generator().manual_seed(0)
    batch = torch.rand(2, 40, 56, 3, generator=gen)
    edit = NodeCall(nodes.NODE_CLASS_MAPPINGS["UniCacheImageEdit"])
    image, latent, _, report = edit.edit(
        model, batch, "make it blue", 2, 0, 4.0, 2.0, 0.0, 1.0, 3.0, 0.0, "text_channel", False
    )
    assert image.shape[0] == 2 and image.shape[-1] == 3 and latent["samples"].shape[:2] == (2, 16)
    assert latent["samples"].shape[2:] == (image.shape[1] // 8, image.shape[2] // 8)
    assert report["method"] == "full" and len(report["batch"]) == 2
    und = NodeCall(nodes.NODE_CLASS_MAPPINGS["UniCacheUnderstand"])
    out = und.understand(model, "What is it?", 3, False, 0.3, 0, False, image=batch[:1])
    text, rep = out["result"]
    assert isinstance(text, str) and out["ui"]["text"] == [text] and rep["task"] == "understanding"


def test_the_node_asks_comfyui_for_the_configured_methods_memory(host_stubs):
    """The task node gives ComfyUI's placement the memory of the KV method it is connected to, with every setting
    (issue #61): UniCache at kv_target 0.9 asks for more than the default UniCache."""
    import nodes

    model = _load(host_stubs)
    mm = host_stubs["comfy.model_management"]
    kv = NodeCall(nodes.NODE_CLASS_MAPPINGS["UniCacheKVConfig"])
    und = NodeCall(nodes.NODE_CLASS_MAPPINGS["UniCacheUnderstand"])
    batch = torch.rand(1, 96, 96, 3, generator=torch.Generator().manual_seed(0))
    asked = {}
    for name, method in {
        "full": None,
        "default": kv("unicache", 0.0, 0.0, -1.0, "default")[0],
        "0.9": kv("unicache", 0.9, 0.0, -1.0, "default")[0],
    }.items():
        und.understand(model, "What is it?", 2, False, 0.3, 0, False, image=batch, kv=method)
        asked[name] = mm.loads[-1][1]
    assert asked["default"] < asked["0.9"], asked  # the tiny model: a key scorer outweighs its KV beside full KV


def test_interrupt_becomes_host_exception(host_stubs):
    import nodes

    model = _load(host_stubs)
    host_stubs["comfy.model_management"].interrupt = True
    node = NodeCall(nodes.NODE_CLASS_MAPPINGS["UniCacheTextToImage"])
    with pytest.raises(Interrupt):
        node.generate(model, "a cube", 32, 32, 3, 0, 4.0, 1.5, 0.4, 1.0, 3.0, 0.0, "global", False)
    assert host_stubs["comfy.model_management"].interrupt is False


def test_bad_inputs_raise_actionable_errors(host_stubs):
    import nodes

    model = _load(host_stubs)
    t2i = NodeCall(nodes.NODE_CLASS_MAPPINGS["UniCacheTextToImage"])
    with pytest.raises(ValueError, match="cfg_interval_lo"):
        t2i.generate(model, "x", 32, 32, 3, 0, 4.0, 1.5, 0.9, 0.1, 3.0, 0.0, "global", False)
    loads = len(host_stubs["comfy.model_management"].loads)
    with pytest.raises(ValueError, match="width"):
        t2i.generate(model, "x", 40, 32, 3, 0, 4.0, 1.5, 0.4, 1.0, 3.0, 0.0, "global", False)
    assert len(host_stubs["comfy.model_management"].loads) == loads
    with pytest.raises(ValueError, match="UniCache BAGEL Loader"):
        t2i.generate("not a model", "x", 32, 32, 3, 0, 4.0, 1.5, 0.4, 1.0, 3.0, 0.0, "global", False)
    with pytest.raises(ValueError, match="KV report"):
        NodeCall(nodes.NODE_CLASS_MAPPINGS["UniCacheKVReport"]).show({"format": "other"})


# ------------------------------------------------------------------------------------------ web extension

_JS_DRAW = r"""
const src = (await import("fs")).readFileSync(process.argv[2], "utf8")
  .replace(/^import .*$/m, "const app = { registerExtension(e) { globalThis.ext = e; } };");
const mod = await import("data:text/javascript," + encodeURIComponent(src));
const calls = [];
const ctx = new Proxy({}, { get: (t, k) => (k in t ? t[k] : (...a) => calls.push(k)),
                            set: (t, k, v) => ((t[k] = v), true) });
mod.drawChart(ctx, JSON.parse(process.argv[3]), 320, 190);
if (!globalThis.ext || !globalThis.ext.beforeRegisterNodeDef || !calls.includes("lineTo")) process.exit(1);
"""


def test_web_extension_parses_and_draws(host_stubs, tmp_path):
    import shutil
    import subprocess

    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    js = ROOT / "web" / "unicache.js"
    subprocess.run([node, "--check", str(js)], check=True)
    import nodes
    from unicache_core.compression import UniCache

    model = _load(host_stubs)
    *_, report = NodeCall(nodes.NODE_CLASS_MAPPINGS["UniCacheTextToImage"]).generate(
        model, "a cube", 32, 32, 3, 0, 4.0, 1.5, 0.4, 1.0, 3.0, 0.0, "global", False, kv=UniCache()
    )
    chart = NodeCall(nodes.NODE_CLASS_MAPPINGS["UniCacheKVReport"]).show(report)["ui"]["unicache_kv"][0]
    script = tmp_path / "draw.mjs"
    script.write_text(_JS_DRAW)
    subprocess.run([node, str(script), str(js), json.dumps(chart)], check=True, timeout=30)
    two_images = dict(
        chart, images={"0": {"full_bytes": 4096, "held_bytes": 1024}, "1": {"full_bytes": 4096, "held_bytes": 512}}
    )
    subprocess.run([node, str(script), str(js), json.dumps(two_images)], check=True, timeout=30)


# ------------------------------------------------------------------------------- external VAE and LATENT


class _FakeComfyVAE:
    """ComfyUI's VAE API (encode [B,H,W,3] in [0,1] → raw FLUX latent; decode raw → [B,H,W,3]) over the tiny VAE."""

    def __init__(self, ae):
        self.ae, self.calls = ae, []

    def encode(self, pixels):
        self.calls.append("encode")
        return self.ae.encode_moments(pixels.permute(0, 3, 1, 2) * 2 - 1)[0]

    def decode(self, samples):
        self.calls.append("decode")
        return ((self.ae.decoder(samples) + 1) / 2).clamp(0, 1).permute(0, 2, 3, 1)


def test_external_vae_and_latent_inputs(host_stubs):
    import nodes

    model = _load(host_stubs)
    vae = _FakeComfyVAE(model.loaded.vae)
    t2i = NodeCall(nodes.NODE_CLASS_MAPPINGS["UniCacheTextToImage"])
    args = (model, "a red cube", 64, 64, 3, 3, 4.0, 1.5, 0.4, 1.0, 3.0, 0.0, "global", False)
    own, own_latent, _, _ = t2i.generate(*args)
    ext, ext_latent, _, _ = t2i.generate(*args, vae=vae)
    assert vae.calls == ["decode"]
    assert torch.equal(own_latent["samples"], ext_latent["samples"])
    assert (own - ext).abs().max() <= 1.5 / 255  # LATENT convention: core VAEDecode of it gives the same image
    edit = NodeCall(nodes.NODE_CLASS_MAPPINGS["UniCacheImageEdit"])
    latent = {"samples": vae.encode(own)}  # what core VAEEncode gives for the same image
    image, out_latent, _, _ = edit.edit(
        model, own, "make it blue", 2, 0, 4.0, 2.0, 0.0, 1.0, 3.0, 0.0, "text_channel", False, vae=vae, latent=latent
    )
    assert image.shape == own.shape and out_latent["samples"].shape == own_latent["samples"].shape
    mm = host_stubs["comfy.model_management"]
    vae.calls, loads = [], len(mm.loads)
    vae.encode = lambda pixels, enc=vae.encode: (vae.calls.append(("encode", len(mm.loads))), enc(pixels))[1]
    image2, *_ = edit.edit(
        model, own, "make it blue", 2, 0, 4.0, 2.0, 0.0, 1.0, 3.0, 0.0, "text_channel", False, vae=vae
    )
    # the source is encoded with ComfyUI's VAE before BAGEL is placed (ComfyUI may offload models to load a VAE)
    assert vae.calls[0] == ("encode", loads) and vae.calls[-1] == "decode" and len(mm.loads) == loads + 1
    assert image2.shape == own.shape
    with pytest.raises(ValueError, match="LATENT"):
        edit.edit(model, own, "x", 2, 0, 4.0, 2.0, 0.0, 1.0, 3.0, 0.0, "text_channel", False, latent={"samples": own})


def test_listing_folders_and_single_files(tmp_path, tiny_checkpoint):
    from safetensors.torch import save_file

    from nodes.model import list_checkpoints

    a, b = tmp_path / "a", tmp_path / "b"
    (a / "org").mkdir(parents=True)
    b.mkdir()
    (a / "tiny").symlink_to(tiny_checkpoint, target_is_directory=True)
    (a / "org" / "nested").symlink_to(tiny_checkpoint, target_is_directory=True)
    (a / "empty_dir").mkdir()
    save_file({"language_model.lm_head.weight": torch.zeros(2, 2)}, str(b / "bagel-single.safetensors"))
    save_file({"encoder.conv_in.weight": torch.zeros(2, 2)}, str(b / "ae.safetensors"))  # a VAE: not listed
    (b / "tiny").mkdir()  # same name as in `a`, no config: not a checkpoint
    assert list_checkpoints([a, b], include_files=False) == ["org/nested", "tiny"]
    assert list_checkpoints([a, b], include_files=True) == ["org/nested", "tiny", "bagel-single.safetensors"]


def test_single_file_checkpoint(host_stubs, tmp_path):
    import nodes
    from training import tiny

    folder_model = _load(host_stubs)
    out = tiny.write_tiny_single_file(tmp_path / "single", seed=0)
    resave_with_low_byte(out, 0x80)  # a header length whose first byte is a pickle's: still a safetensors file
    bagel = Path(host_stubs["folder_paths"].models_dir) / "bagel"
    (bagel / "bagel-tiny.safetensors").symlink_to(out)
    (bagel / "ae.safetensors").symlink_to(out.parent / "ae.safetensors")  # a VAE beside it is not listed
    encoders = Path(host_stubs["comfy.utils"].__file__).parent / "text_encoders"
    encoders.mkdir(parents=True)
    (encoders / "qwen25_tokenizer").symlink_to(out.parent / "tokenizer", target_is_directory=True)
    loader = nodes.NODE_CLASS_MAPPINGS["UniCacheBagelLoader"]
    choices = loader.INPUT_TYPES()["required"]["checkpoint"][1]["options"]
    assert "bagel-tiny.safetensors" in choices and "ae.safetensors" not in choices
    (model,) = NodeCall(loader)("bagel-tiny.safetensors", "fp32", "cpu")
    assert model.loaded.vae is None and model is not folder_model
    t2i = NodeCall(nodes.NODE_CLASS_MAPPINGS["UniCacheTextToImage"])
    args = (model, "a red cube", 32, 32, 3, 3, 4.0, 1.5, 0.4, 1.0, 3.0, 0.0, "global", False)
    mm = host_stubs["comfy.model_management"]
    loads = len(mm.loads)
    with pytest.raises(ValueError, match="VAELoader"):
        t2i.generate(*args)
    assert len(mm.loads) == loads  # refused before the model is placed on the device
    image, latent, _, report = t2i.generate(*args, vae=_FakeComfyVAE(folder_model.loaded.vae))
    assert image.shape == (1, 32, 32, 3) and latent["samples"].shape == (1, 16, 4, 4) and report["steps"]


def test_only_host_module_imports_comfyui():
    import ast

    host_modules = {"comfy", "folder_paths", "server", "comfy_api", "node_helpers", "latent_preview"}
    offenders = []
    for path in [
        ROOT / "__init__.py",
        *sorted((ROOT / "nodes").glob("*.py")),
        *sorted((ROOT / "unicache_core").rglob("*.py")),
    ]:
        if path == ROOT / "nodes" / "host.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            )
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in host_modules]
    assert offenders == []


def test_bundled_checkpoint_is_the_loaders_default():
    """The loader's default choice is the checkpoint the CLI defaults to, shipped in the pack's model folder."""
    from nodes import host
    from nodes.loader_node import UniCacheBagelLoader
    from unicache_core.bagel.settings import BUNDLED_CHECKPOINT, BUNDLED_CHECKPOINT_DIR

    assert UniCacheBagelLoader.INPUT_TYPES()["required"]["checkpoint"][1]["default"] == BUNDLED_CHECKPOINT
    assert BUNDLED_CHECKPOINT_DIR == host.PACK_BAGEL_DIR / BUNDLED_CHECKPOINT
    assert (BUNDLED_CHECKPOINT_DIR / "llm_config.json").is_file(), "the bundled model must ship in git"


def test_a_fifo_in_the_policy_folder_is_named_as_a_fifo(host_stubs):
    """ComfyUI's get_full_path finds regular files only, so a FIFO the policy list shows was "not found"; the node
    hands it to the table reader, which names it (and never opens it: a FIFO would block)."""
    import os

    from nodes import host
    from unicache_core.compression.policy_table import PolicyTableError, resolve_policy_table

    folder = Path(host_stubs["folder_paths"].models_dir) / "unicache_policies"
    folder.mkdir(parents=True)
    os.mkfifo(folder / "fifo.json")
    assert "fifo.json" in host.policy_files()
    path = host.policy_path("fifo.json")
    assert path == folder / "fifo.json"
    with pytest.raises(PolicyTableError, match=r"fifo.json' is a FIFO \(named pipe\), not a regular file"):
        resolve_policy_table(str(path), "", "")
    with pytest.raises(FileNotFoundError, match="not found in the unicache_policies folders"):
        host.policy_path("absent.json")
