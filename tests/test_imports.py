"""unicache_core must import without ComfyUI and without side effects."""

import json
import subprocess
import sys

import pytest

# the module's tests share one probe interpreter: keep them on one xdist worker (make test's --dist loadgroup)
pytestmark = pytest.mark.xdist_group("import_probe")

FORBIDDEN = ("comfy", "folder_paths", "server", "nodes", "execution")


#: One fresh interpreter runs the import steps below in order and reports what each step left loaded (a fresh
#: interpreter costs ~3 s of a test core; five of them were the suite's slowest import checks). Each step's module
#: set contains the earlier steps' modules, so its checks are at least as strict as in a fresh interpreter of its
#: own. What the imports printed (stdout and stderr, at the file-descriptor level) ends at a marker line written
#: after the third step; the report goes to a file, not to stdout.
_PROBE = """
import importlib, json, os, pkgutil, sys
report = {}
import unicache_core
report['core'] = sorted(sys.modules)
def walk(pkg):
    for info in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + '.'):
        if info.name.startswith('unicache_core.bagel'):
            continue  # walk_packages would import it to recurse
        mod = importlib.import_module(info.name)
        if info.ispkg:
            walk(mod)
walk(unicache_core)
report['compression_core_bagel'] = sorted(m for m in sys.modules if m.startswith('unicache_core.bagel'))
import unicache_core.bagel
report['engine'] = sorted(sys.modules)
sys.stdout.flush(); sys.stderr.flush()
os.write(1, b'<marker>\\n'); os.write(2, b'<marker>\\n')
import benchmarks
names = []
for pkg in (unicache_core, benchmarks):
    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):
        if info.name.endswith('__main__'):
            continue
        importlib.import_module(info.name)
        names.append(info.name)
report['every'] = [names, sorted(sys.modules)]
with open(sys.argv[1], 'w') as f:
    json.dump(report, f)
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> dict:
    """The import steps of :data:`_PROBE` in one fresh interpreter: ``{step: modules}`` plus what the first
    three steps printed (``"printed"``: ``(stdout, stderr)`` before the marker)."""
    path = tmp_path_factory.mktemp("imports") / "report.json"
    out = subprocess.run([sys.executable, "-c", _PROBE, str(path)], capture_output=True, text=True, check=True)
    report = json.loads(path.read_text())
    report["printed"] = (out.stdout.split("<marker>")[0], out.stderr.split("<marker>")[0])
    return report


def _leaked(modules: list[str]) -> list[str]:
    return [m for m in modules if m.split(".")[0] in FORBIDDEN]


def test_core_imports_without_comfyui(probe):
    assert _leaked(probe["core"]) == [], f"importing unicache_core pulled in {_leaked(probe['core'])}"


def test_bagel_engine_imports_without_comfyui(probe):
    assert _leaked(probe["engine"]) == [], f"importing unicache_core.bagel pulled in {_leaked(probe['engine'])}"


def test_every_module_imports_without_comfyui(probe):
    """Walk the whole package (compression, stores, quant, segmented, bagel.*) and the benchmarks."""
    names, loaded = probe["every"]
    for expected in (
        "unicache_core.compression.methods.h2o",
        "unicache_core.compression.methods.unicache",
        "unicache_core.compression.schedule",
        "unicache_core.kv.stores",
        "unicache_core.kv.segmented_cache",
        "unicache_core.bagel.pipeline",
        "benchmarks.kv_attention",
    ):
        assert expected in names
    assert _leaked(loaded) == [], f"importing the whole package pulled in {_leaked(loaded)}"


def test_no_module_imports_triton_at_import(probe):
    """Triton is imported only when the packed-KV kernel is first built (unicache_core/kv/packed_attention_triton.py),
    so the library and the benchmarks import without it."""
    names, loaded = probe["every"]
    assert "unicache_core.kv.packed_attention_triton" in names and "benchmarks.gpu_kernels" in names
    assert [m for m in loaded if m.split(".")[0] == "triton"] == []


def test_import_prints_nothing(probe):
    """Importing unicache_core, every model-agnostic module and unicache_core.bagel writes nothing at all."""
    assert probe["printed"] == ("", "")


def test_compression_core_never_imports_the_bagel_engine(probe):
    """Everything outside unicache_core.bagel (KV core, compression methods, ...) is model-agnostic."""
    assert probe["compression_core_bagel"] == []


def test_pack_entry_imports_as_a_plain_module():
    """pytest imports the checkout's ``__init__.py`` as a top-level "__init__" when the folder name is not an
    identifier (a clone into "comfyui-unicache-bagel"); the entry must still import there."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "__init__.py"
    spec = importlib.util.spec_from_file_location("__init__", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert callable(module.comfy_entrypoint) and module.WEB_DIRECTORY == "./web"


def test_engine_constants_and_node_glue_have_one_home():
    """MAX_SEED is assigned in seeding.py only, the FLUX latent scale/shift are literals in latents.py only, the
    bundled checkpoint's name is a literal in settings.py only (tools/model_card.py, which writes that model's
    card, names it on its own), and the nodes never probe the library's signatures (it ships in the same
    repository)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    seeds, flux, bundled, probes = [], [], [], []
    for folder in ("unicache_core", "unicache_commands", "nodes", "benchmarks", "tools", "training"):
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
