"""The pack inside a real ComfyUI 0.3.75 server: node listing, shipped workflows, queueing, errors, interrupt."""

from __future__ import annotations

import io
import json
import time

import pytest
from hostlib import (
    CONTRACT_TASK_NODES,
    WORKFLOWS_API,
    WORKFLOWS_UI,
    describe,
    load_api_workflow,
    messages,
    small_size,
    t2i_graph,
    understand_graph,
)

pytestmark = pytest.mark.host

BUNDLED_NAME = "bagel-tiny"  # the tiny random test checkpoint (fast graphs)
SHAPES_NAME = "unicache-shapes"  # the trained default the shipped workflows use
CORRUPT_NAME = "corrupt-tiny"

#: docs/nodepack-contract.md: node id -> (inputs, output types, output node?).
CONTRACT = {
    "UniCacheBagelLoader": ({"checkpoint", "dtype", "device", "weight_dtype"}, ["BAGEL_MODEL"], False),
    "UniCacheKVConfig": ({"method", "kv_target", "rho", "rho_floor", "policy", "score_queries"}, ["UNICACHE_KV"],
                         False),
    "UniCacheTextToImage": (
        {"model", "prompt", "width", "height", "steps", "seed", "cfg_text_scale", "cfg_img_scale", "cfg_interval_lo",
         "cfg_interval_hi", "timestep_shift", "cfg_renorm_min", "cfg_renorm_type", "think", "kv", "vae"},
        ["IMAGE", "LATENT", "STRING", "UNICACHE_KV_REPORT"], False),
    "UniCacheImageEdit": (
        {"model", "image", "prompt", "steps", "seed", "cfg_text_scale", "cfg_img_scale", "cfg_interval_lo",
         "cfg_interval_hi", "timestep_shift", "cfg_renorm_min", "cfg_renorm_type", "kv", "vae", "latent"},
        ["IMAGE", "LATENT", "STRING", "UNICACHE_KV_REPORT"], False),
    "UniCacheUnderstand": ({"model", "prompt", "max_new_tokens", "do_sample", "temperature", "seed", "think", "image",
                            "kv"}, ["STRING", "UNICACHE_KV_REPORT"], True),
    "UniCacheKVReport": ({"report"}, ["IMAGE", "STRING"], True),
}  # fmt: skip


@pytest.fixture(scope="module")
def info(comfy):
    return comfy.object_info()


def _outputs_check(comfy, entry: dict) -> dict:
    """Every output of a finished prompt comes back: images decode with PIL, texts are non-empty."""
    from PIL import Image

    counts = {"images": 0, "texts": 0}
    for nid, out in entry["outputs"].items():
        for img in out.get("images", []):
            data = comfy.view(img)
            with Image.open(io.BytesIO(data)) as im:
                im.load()
                assert im.size[0] > 0 and im.size[1] > 0
            counts["images"] += 1
        for text in out.get("text", []):
            assert isinstance(text, str) and text.strip(), f"node {nid}: empty text output"
            counts["texts"] += 1
    assert counts["images"] + counts["texts"] > 0, f"no image or text came back: {json.dumps(entry['outputs'])[:800]}"
    return counts


# ------------------------------------------------------------------------------------------ listing


@pytest.mark.parametrize("node_id", sorted(CONTRACT))
def test_object_info_lists_contract_node(info, node_id):
    assert node_id in info, f"{node_id} missing from /object_info"
    spec = info[node_id]
    inputs, outputs, is_output = CONTRACT[node_id]
    declared = {**spec["input"].get("required", {}), **spec["input"].get("optional", {})}
    assert inputs <= set(declared), f"{node_id} lacks inputs {sorted(inputs - set(declared))}"
    assert list(spec["output"])[: len(outputs)] == outputs
    assert bool(spec["output_node"]) is is_output
    assert spec["category"].startswith("UniCache"), spec["category"]
    assert spec.get("description"), f"{node_id} has no DESCRIPTION"
    for name, s in declared.items():
        opts = s[1] if len(s) > 1 and isinstance(s[1], dict) else {}
        assert opts.get("tooltip"), f"{node_id}.{name} has no tooltip"


def test_loader_offers_bundled_checkpoints(info):
    """The trained unicache-shapes model is offered and is the default; the tiny test checkpoint is offered too."""
    spec = info["UniCacheBagelLoader"]["input"]["required"]["checkpoint"]
    choices, opts = spec[0], spec[1] if len(spec) > 1 else {}
    if choices == "COMBO":
        choices = opts["options"]
    assert SHAPES_NAME in choices and any(c.rsplit("/", 1)[-1].startswith(BUNDLED_NAME) for c in choices), choices
    assert opts.get("default") == SHAPES_NAME, opts


def test_seed_inputs_are_64_bit(info):
    for node_id in ("UniCacheTextToImage", "UniCacheImageEdit", "UniCacheUnderstand"):
        kind, opts = info[node_id]["input"]["required"]["seed"][:2]
        assert kind == "INT" and opts["min"] == 0 and opts["max"] == 2**64 - 1, (node_id, opts)
        assert opts.get("control_after_generate"), node_id


def test_web_extension_served(comfy):
    listed = comfy.get("/extensions")
    ours = [p for p in listed if p.startswith("/extensions/comfyui-unicache-bagel/")]
    assert any(p.endswith("/unicache.js") for p in ours), listed
    status, data, ctype = comfy.get_bytes(next(p for p in ours if p.endswith("/unicache.js")))
    assert status == 200 and b"registerExtension" in data and "javascript" in ctype


# --------------------------------------------------------------------------------- shipped workflows


def _shipped_names() -> list[str]:
    return sorted(p.stem for p in WORKFLOWS_API.glob("*.json")) or ["(no workflows/api/*.json shipped)"]


def test_shipped_workflows_cover_the_contract():
    """API workflows for t2i, edit, understand and an A/B edit (two edit nodes), each with a UI twin."""
    graphs = {p.stem: json.loads(p.read_text()) for p in WORKFLOWS_API.glob("*.json")}
    types = [[n["class_type"] for n in g.values()] for g in graphs.values()]
    for task in CONTRACT_TASK_NODES:
        assert any(task in t for t in types), f"no shipped API workflow uses {task}"
    assert any(t.count("UniCacheImageEdit") >= 2 for t in types), "no A/B edit workflow (two edit nodes)"
    ui = {p.stem for p in WORKFLOWS_UI.glob("*.json")}
    assert set(graphs) <= ui, f"API workflows without a UI twin: {sorted(set(graphs) - ui)}"
    assert all("UniCacheKVReport" in t for t in types), "every shipped workflow shows its KV report"


@pytest.mark.parametrize("name", _shipped_names())
def test_shipped_api_workflow_runs(comfy, name):
    prompt = load_api_workflow(name)
    t0 = time.monotonic()
    entry = comfy.run(prompt)
    assert entry["status"]["status_str"] == "success", describe(entry)
    counts = _outputs_check(comfy, entry)
    print(f"{name}: {time.monotonic() - t0:.1f} s, {counts}")


def _image(comfy, entry: dict, node: str):
    from PIL import Image

    with Image.open(io.BytesIO(comfy.view(entry["outputs"][node]["images"][0]))) as im:
        return im.convert("RGB")


def test_shipped_workflows_draw_and_answer_in_the_models_world(comfy):
    """On the bundled unicache-shapes model (UniCache KV) the shipped workflows do what they ask: the t2i image has
    the prompt's white background and the red circle where the prompt puts it, the edit turns the example's
    background black and keeps its three objects in their cells (red and blue keep their colour; this model
    turns the yellow triangle green here, its unchanged-region PSNR is 18.4 dB on the quality bench), and the
    position question about the one-object example gets its cell ("top right").

    Exact correctness over many held-out samples is what the quality benchmark measures (docs/quality.md)."""
    from unicache_core.shapes import analyse

    t2i = load_api_workflow("text_to_image")
    assert t2i["1"]["inputs"]["checkpoint"] == "unicache-shapes"
    entry = comfy.run(t2i)
    assert entry["status"]["status_str"] == "success", describe(entry)
    seen = analyse(_image(comfy, entry, "4"))
    assert seen.background == "white" and seen.objects, seen
    assert any(o.cell == 0 and o.color == "red" and o.shape == "circle" for o in seen.objects), seen

    edit = load_api_workflow("image_edit")
    assert edit["4"]["inputs"]["prompt"] == "change the background to black"
    entry = comfy.run(edit)
    assert entry["status"]["status_str"] == "success", describe(entry)
    got = analyse(_image(comfy, entry, "5"))
    assert got.background == "black", got
    colour_at = {o.cell: o.color for o in got.objects}
    assert set(colour_at) == {0, 4, 8} and colour_at[0] == "red" and colour_at[4] == "blue", got

    und = load_api_workflow("understanding")
    assert und["4"]["inputs"]["prompt"] == "where is the red circle?"
    assert und["3"]["inputs"]["image"] == "unicache_position.png"
    entry = comfy.run(und)
    assert entry["status"]["status_str"] == "success", describe(entry)
    assert entry["outputs"]["4"]["text"][0].strip() == "top right", entry["outputs"]["4"]


# ----------------------------------------------------------------------------------------- queueing


def test_batch_of_five_seeds_loads_once(comfy, info):
    """Five queued prompts with different seeds all succeed; the loader runs once (cached afterwards)."""
    size = small_size(info, "UniCacheTextToImage")
    ids = [comfy.submit(t2i_graph(info, BUNDLED_NAME, steps=3, seed=1000 + i, **size)) for i in range(5)]
    entries = [comfy.wait(pid) for pid in ids]
    for e in entries:
        assert e["status"]["status_str"] == "success", describe(e)
        _outputs_check(comfy, e)
    # The loader ("1") and KV config ("2") never ran again after the first prompt of the batch (which may
    # itself have found them cached from an earlier test).
    for e in entries[1:]:
        cached = {n for m in messages(e, "execution_cached") for n in m.get("nodes", [])}
        assert {"1", "2"} <= cached, f"loader re-ran: cached {sorted(cached)}"
        assert "3" not in cached, "a new seed must re-run the generation"
    images = [comfy.view(e["outputs"]["4"]["images"][0]) for e in entries]
    assert len(set(images)) == 5, "different seeds gave identical images"


# ------------------------------------------------------------------------------------------- errors


def _node_error_inputs(body: dict) -> dict[str, set[str]]:
    out = {}
    for nid, ne in (body.get("node_errors") or {}).items():
        out[nid] = {e.get("extra_info", {}).get("input_name") for e in ne.get("errors", [])}
    return out


def test_rho_out_of_range_is_http_400(comfy, info):
    status, body = comfy.queue(understand_graph(info, BUNDLED_NAME, kv={"rho": 1.5}))
    assert status == 400, body
    assert "rho" in _node_error_inputs(body).get("2", set()), json.dumps(body)[:2000]


def test_unknown_checkpoint_is_http_400(comfy, info):
    graph = understand_graph(info, BUNDLED_NAME)
    graph["1"]["inputs"]["checkpoint"] = "no-such-checkpoint"
    status, body = comfy.queue(graph)
    assert status == 400, body
    assert "checkpoint" in _node_error_inputs(body).get("1", set()), json.dumps(body)[:2000]


def _assert_next_prompt_succeeds(comfy, info):
    entry = comfy.run(understand_graph(info, BUNDLED_NAME, prompt="Still working?"))
    assert entry["status"]["status_str"] == "success", describe(entry)


def test_floor_above_rho_is_an_error_naming_it(comfy, info):
    """rho_floor above rho: each value is within its bounds, the pair is not; the error names rho_floor."""
    status, body = comfy.queue(understand_graph(info, BUNDLED_NAME, kv={"rho": 0.2, "rho_floor": 0.6}))
    if status == 400:  # refused at validation (VALIDATE_INPUTS): acceptable, it must still name the input
        assert "rho_floor" in json.dumps(body), body
    else:
        assert status == 200, body
        entry = comfy.wait(body["prompt_id"])
        assert entry["status"]["status_str"] == "error"
        err = messages(entry, "execution_error")
        assert err and err[0]["node_type"] == "UniCacheKVConfig", describe(entry)
        assert "rho_floor" in err[0]["exception_message"], err[0]["exception_message"]
    _assert_next_prompt_succeeds(comfy, info)


def test_corrupt_checkpoint_is_execution_error(comfy, info):
    entry = comfy.run(understand_graph(info, CORRUPT_NAME))
    assert entry["status"]["status_str"] == "error", "a truncated ema.safetensors loaded?"
    err = messages(entry, "execution_error")
    assert err and err[0]["node_type"] == "UniCacheBagelLoader", describe(entry)
    msg = err[0]["exception_message"]
    assert CORRUPT_NAME in msg or "ema.safetensors" in msg, msg
    _assert_next_prompt_succeeds(comfy, info)


def test_interrupt_long_generation_keeps_host_working(comfy, info):
    steps_max = info["UniCacheTextToImage"]["input"]["required"]["steps"][1].get("max", 200)
    size = small_size(info, "UniCacheTextToImage")
    pid = comfy.submit(t2i_graph(info, BUNDLED_NAME, steps=min(steps_max, 1000), seed=7, **size))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # wait until it is the running prompt
        running = comfy.get("/queue")["queue_running"]
        if any(item[1] == pid for item in running):
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the long prompt never started")
    time.sleep(2.0)  # inside the denoising loop
    status, _ = comfy.request("POST", "/interrupt", {})
    assert status == 200
    t0 = time.monotonic()
    entry = comfy.wait(pid, timeout=120)
    assert messages(entry, "execution_interrupted"), describe(entry)
    print(f"interrupt took effect after {time.monotonic() - t0:.1f} s")
    _assert_next_prompt_succeeds(comfy, info)
    assert comfy.get("/system_stats")["system"]["comfyui_version"]
