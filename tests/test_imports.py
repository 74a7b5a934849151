"""unicache_core must import without ComfyUI and without side effects."""

import subprocess
import sys

FORBIDDEN = ("comfy", "folder_paths", "server", "nodes", "execution")


def _modules_after_import(module: str) -> set[str]:
    code = (
        "import sys, json\n"
        f"import {module}\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    import json

    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_core_imports_without_comfyui():
    loaded = _modules_after_import("unicache_core")
    leaked = [m for m in loaded if m.split(".")[0] in FORBIDDEN]
    assert leaked == [], f"importing unicache_core pulled in {leaked}"


def test_bagel_engine_imports_without_comfyui():
    loaded = _modules_after_import("unicache_core.bagel")
    leaked = [m for m in loaded if m.split(".")[0] in FORBIDDEN]
    assert leaked == [], f"importing unicache_core.bagel pulled in {leaked}"


def test_every_module_imports_without_comfyui():
    """Walk the whole package (compression, stores, quant, segmented, bagel.*) and the benchmarks."""
    code = (
        "import importlib, json, pkgutil, sys\n"
        "import unicache_core, benchmarks\n"
        "names = []\n"
        "for pkg in (unicache_core, benchmarks):\n"
        "    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        if info.name.endswith('__main__'):\n"
        "            continue\n"
        "        importlib.import_module(info.name)\n"
        "        names.append(info.name)\n"
        "print(json.dumps([names, sorted(sys.modules)]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    import json

    names, loaded = json.loads(out.stdout.strip().splitlines()[-1])
    for expected in ("unicache_core.compression.baselines", "unicache_core.compression.schedule", "unicache_core.kv.stores",
                     "unicache_core.kv.segmented_cache", "unicache_core.bagel.pipeline", "benchmarks.kv_attention"):
        assert expected in names
    leaked = [m for m in loaded if m.split(".")[0] in FORBIDDEN]
    assert leaked == [], f"importing the whole package pulled in {leaked}"


def test_import_prints_nothing():
    out = subprocess.run(
        [sys.executable, "-c", "import unicache_core, unicache_core.bagel"], capture_output=True, text=True, check=True
    )
    assert out.stdout == "" and out.stderr == ""


def test_compression_core_never_imports_the_bagel_engine():
    """Everything outside unicache_core.bagel (KV core, compression methods, ...) is model-agnostic."""
    code = (
        "import importlib, json, pkgutil, sys\n"
        "def walk(pkg):\n"
        "    for info in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + '.'):\n"
        "        if info.name.startswith('unicache_core.bagel'):\n"
        "            continue  # walk_packages would import it to recurse\n"
        "        mod = importlib.import_module(info.name)\n"
        "        if info.ispkg:\n"
        "            walk(mod)\n"
        "import unicache_core\n"
        "walk(unicache_core)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('unicache_core.bagel'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    import json

    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_pack_entry_imports_as_a_plain_module():
    """pytest imports the checkout's ``__init__.py`` as a top-level "__init__" when the folder name is not an
    identifier (a clone into "comfyui-unicache-bagel"); the entry must still import there."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "__init__.py"
    spec = importlib.util.spec_from_file_location("__init__", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert "UniCacheBagelLoader" in module.NODE_CLASS_MAPPINGS and module.WEB_DIRECTORY == "./web"


def test_engine_constants_and_node_glue_have_one_home():
    """MAX_SEED is assigned in seeding.py only, the FLUX latent scale/shift are literals in latents.py only, the
    bundled checkpoint's name is a literal in settings.py only (tools/model_card.py, which writes that model's
    card, names it on its own), and the nodes never probe the library's signatures (it ships in the same
    repository)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    seeds, flux, bundled, probes = [], [], [], []
    for folder in ("unicache_core", "nodes", "benchmarks", "tools", "training"):
        for path in (root / folder).rglob("*.py"):
            rel = path.relative_to(root).as_posix()
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MAX_SEED" for t in node.targets):
                    seeds.append(rel)
                if isinstance(node, ast.Constant) and node.value in (0.3611, 0.1159):
                    flux.append(rel)
                if isinstance(node, ast.Constant) and node.value == "unicache-shapes" and rel != "tools/model_card.py":
                    bundled.append(rel)
                if isinstance(node, ast.Attribute) and node.attr == "signature" and rel.startswith("nodes/"):
                    probes.append(rel)
    assert seeds == ["unicache_core/bagel/seeding.py"]
    assert flux == ["unicache_core/bagel/latents.py"] * 2
    assert bundled == ["unicache_core/bagel/settings.py"]
    assert probes == []
