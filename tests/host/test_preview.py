"""Live latent previews in a real host started with ``--preview-method latent2rgb``: the generation nodes
send one JPEG preview per denoising step over the websocket (ComfyUI's binary preview frames)."""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import pytest
from hostlib import Comfy, comfyhost, describe, small_size, t2i_graph

pytestmark = pytest.mark.host


@pytest.fixture(scope="module")
def preview_host(host_install, bundled_checkpoint, tmp_path_factory):
    base = comfyhost.prepare_base(tmp_path_factory.mktemp("previewbase"))
    host = comfyhost.start(base, extra=["--preview-method", "latent2rgb"], timeout=240)
    client = Comfy(host.url, base, Path(host.log))
    yield client
    comfyhost.stop(host)


def test_generation_sends_a_latent_preview_per_step(preview_host):
    import websocket  # websocket-client (the batch extra)
    from PIL import Image

    comfy = preview_host
    info = comfy.object_info()
    ws = websocket.create_connection(
        comfy.url.replace("http", "ws", 1) + f"/ws?clientId={comfy.client_id}", timeout=120
    )
    try:
        prompt_id = comfy.submit(
            t2i_graph(info, "bagel-tiny", steps=4, seed=3, **small_size(info, "UniCacheTextToImage"))
        )
        previews = []
        while True:
            frame = ws.recv()
            if isinstance(frame, bytes):
                event, fmt = struct.unpack(">II", frame[:8])
                if event == 1:  # PREVIEW_IMAGE: format id, then the encoded image
                    with Image.open(io.BytesIO(frame[8:])) as im:
                        im.load()
                        previews.append(im.size)
                continue
            msg = json.loads(frame)
            if (
                msg.get("type") == "executing"
                and msg["data"].get("node") is None
                and msg["data"].get("prompt_id") == prompt_id
            ):
                break
    finally:
        ws.close()
    entry = comfy.wait(prompt_id)
    assert entry["status"]["status_str"] == "success", describe(entry)
    assert len(previews) >= 3, previews  # steps=4 -> 3 denoising steps, one preview each
    assert all(w > 0 and h > 0 for w, h in previews)
