"""The loader node in a real ComfyUI 0.3.75 host, on checkpoints whose configs claim what their weights do not hold
(issue 45.1): ``num_hidden_layers: 10000000`` and its kin end in one ``execution_error`` line in the node, naming the
config file and the key, before any module is built (a hang would exceed the run's 60 s), and the host keeps
working."""

from __future__ import annotations

import json
import shutil

import pytest
from hostlib import describe, messages, understand_graph

pytestmark = pytest.mark.host

BUNDLED_NAME = "bagel-tiny"
#: (checkpoint folder, config file, changes, what the message names)
CASES = [
    ("huge-layers-tiny", "llm_config.json", {"num_hidden_layers": 10_000_000}, "num_hidden_layers = 10000000"),
    ("huge-vit-tiny", "vit_config.json", {"num_hidden_layers": 10_000_000}, "num_hidden_layers = 10000000"),
    ("huge-blocks-tiny", "ae_config.json", {"num_res_blocks": 10_000_000}, "'num_res_blocks' = 10000000"),
    ("huge-width-tiny", "llm_config.json", {"hidden_size": 10_000_000}, "vocab_size and hidden_size"),
    ("float-heads-tiny", "llm_config.json", {"num_attention_heads": 1.5}, "'num_attention_heads' = 1.5"),
    ("huge-eps-tiny", "llm_config.json", {"rms_norm_eps": 10_000_000}, "'rms_norm_eps' = 10000000"),
]


@pytest.fixture(scope="module")
def hostile(comfy, bundled_checkpoint):
    """The tiny checkpoint copied under the host's bagel folder once per case, with one config edited."""
    for name, file, changes, _ in CASES:
        folder = comfy.base / "models" / "bagel" / name
        shutil.copytree(bundled_checkpoint, folder, dirs_exist_ok=True)
        data = json.loads((folder / file).read_text())
        data.update(changes)
        (folder / file).write_text(json.dumps(data))
    return comfy.object_info()


@pytest.mark.parametrize("name, file, changes, needle", CASES, ids=[case[0] for case in CASES])
def test_hostile_config_is_one_line_in_the_loader_node(comfy, hostile, name, file, changes, needle):
    entry = comfy.run(understand_graph(hostile, name), timeout=60)
    assert entry["status"]["status_str"] == "error", describe(entry)
    error = messages(entry, "execution_error")[0]
    message = error["exception_message"].strip()
    assert error["node_type"] == "UniCacheBagelLoader", describe(entry)
    assert f"{name}/{file}" in message and needle in message and message.count("\n") == 0, message
    started = messages(entry, "execution_start")[0]["timestamp"]
    print(f"\n{name}: refused {(error['timestamp'] - started) / 1000:.2f} s after the prompt started: {message}")


def test_host_keeps_working_after_the_hostile_checkpoints(comfy, hostile):
    after = comfy.run(understand_graph(hostile, BUNDLED_NAME, prompt="Still working?"))
    assert after["status"]["status_str"] == "success", describe(after)
