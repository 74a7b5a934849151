"""Round four of the hardening (issue 49), what was still open: a host that accepts /prompt and never answers costs
no more than the batch's --timeout, an empty prompt's KV report says there was nothing to compress, fp16 overflow
in a step is named as the step's own non-finite values with the advice to use bf16 (not blamed on the quantizer),
a FIFO policy table in the checkpoint is refused, and the advice of the policy and method errors fits the command."""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time

import pytest
import torch
from checkpoint_edits import rewrite_tensors
from cli_runs import run_bagel_cli
from test_cli_errors import no_weights  # noqa: F401  (a fixture)

from unicache_core.bagel import BagelPipeline, load_bagel, preset
from unicache_core.compression import PolicyTable, make_cache_factory, method_from_name
from unicache_core.compression.report_view import summary_text
from unicache_core.errors import NumericalError


class SilentServer:
    """A TCP server on 127.0.0.1 that accepts every connection and never answers (nor closes it)."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)

    def _accept(self):
        while not self.stop.is_set():
            try:
                self.held.append(self.sock.accept()[0])
            except TimeoutError:
                continue

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        for conn in self.held:
            conn.close()
        self.sock.close()


def test_batch_returns_at_its_timeout_when_prompt_never_answers(tmp_path, capsys):
    from tools.batch import cli

    workflow = tmp_path / "wf.json"
    workflow.write_text(json.dumps({"1": {"class_type": "X", "inputs": {}}}))
    with SilentServer() as server:
        start = time.monotonic()
        argv = [str(workflow), "--host", server.url, "--count", "1", "--out", str(tmp_path / "o"), "--timeout", "3"]
        rc = cli.main(argv)
        took = time.monotonic() - start
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert rc == 1 and summary["runs"][0]["status"] == "failed", summary
    assert took < 3 + 5, f"the batch took {took:.1f} s with --timeout 3"  # it waited 60 s per exchange before


def test_empty_prompt_report_says_nothing_was_compressible(tiny_checkpoint):
    pipe = BagelPipeline(load_bagel(tiny_checkpoint, dtype="fp32"), make_cache_factory("unicache"))
    report = pipe.text_to_image("", preset("t2i", width=32, height=32, num_timesteps=2)).kv_report
    assert report["summary"]["full_managed_bytes"] == 0
    text = summary_text(report)
    assert "compressible KV: none (the context holds no compressible tokens, e.g. an empty prompt)" in text
    assert "0.00x less" not in text


@pytest.fixture(scope="module")
def kv_overflow_checkpoint(tmp_path_factory, tiny_checkpoint):
    """Finite fp16 weights (6e4 at most) whose first layer's values overflow fp16 before they are cached."""
    dst = tmp_path_factory.mktemp("kv_overflow") / "ckpt"
    shutil.copytree(tiny_checkpoint, dst)

    def edit(tensors):
        name = "language_model.model.layers.0.self_attn.v_proj.weight"
        tensors[name] = tensors[name] * (6e4 / float(tensors[name].abs().max()))

    rewrite_tensors(dst / "ema.safetensors", edit)
    return dst


def test_fp16_overflow_in_the_kv_is_named_as_the_steps_values(kv_overflow_checkpoint):
    pipe = BagelPipeline(load_bagel(kv_overflow_checkpoint, dtype="fp16"), make_cache_factory("kivi"))
    with pytest.raises(NumericalError) as caught:
        pipe.text_to_image("a red square in the middle", preset("t2i", width=32, height=32, num_timesteps=2))
    message = str(caught.value)
    assert message.startswith("denoising step 1 of 1: the keys/values the model computed hold ")
    assert "non-finite (NaN/inf) values" in message and "run it in bf16" in message
    assert "cannot be quantized" not in message


def test_fp16_weights_overflow_advice_names_the_weight_storage(tiny_checkpoint_copy):
    from checkpoint_edits import set_value

    name = "language_model.model.layers.0.self_attn.o_proj.weight"
    rewrite_tensors(tiny_checkpoint_copy / "ema.safetensors", set_value(name, 1e5))
    with pytest.raises(NumericalError, match=r"keep fp16 out of the weights: .*--dtype bf16 --weight-dtype auto"):
        load_bagel(tiny_checkpoint_copy, dtype="bf16", weight_dtype="fp16")
    assert load_bagel(tiny_checkpoint_copy, dtype="bf16", weight_dtype="bf16").dtype == torch.bfloat16


def test_a_fifo_policy_table_in_the_checkpoint_is_refused(tiny_checkpoint_copy, tmp_path, no_weights, capsys):
    os.mkfifo(tiny_checkpoint_copy / "unicache_policy.json")
    argv = ["t2i", "--checkpoint", str(tiny_checkpoint_copy), "--prompt", "x", "--kv-method", "unicache"]
    code, out, err = run_bagel_cli(capsys, *argv, "--out", str(tmp_path / "o.png"), "-q")
    assert code == 2 and err.count("\n") == 1, err
    assert "unicache_policy.json" in err and "is a FIFO (named pipe), not a regular file" in err, err


def test_policy_advice_fits_where_it_is_given(tiny_checkpoint, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"drop `policy` or choose the unicache method"):
        method_from_name("full", policy="x.json")
    other = tmp_path / "other.json"
    PolicyTable(model_id="someone-else").save(other)
    from unicache_core.bagel.calibration.cli import main

    (tmp_path / "p.txt").write_text("a prompt\n")
    argv = ["--checkpoint", str(tiny_checkpoint), "--task", "t2i", "--prompts", str(tmp_path / "p.txt")]
    assert main([*argv, "--out", str(other), "--merge"]) == 2
    err = capsys.readouterr().err
    assert "--merge: the table at --out" in err and "give --out a new path" in err and "--policy" not in err, err
    from unicache_core.compression.policy_table import PolicyTableError, resolve_policy_table

    with pytest.raises(PolicyTableError, match=r"or leave the policy unset to use the checkpoint's own") as caught:
        resolve_policy_table(str(other), str(tiny_checkpoint), "sha256:mine")
    assert "--policy" not in str(caught.value)  # the same words for the node's policy widget and the command line
