"""tools/batch without a host: graph variation, seed and prompt files, KV figures, arguments."""

from __future__ import annotations

import json

import pytest

from tools.batch import cli, work

GRAPH = {
    "1": {"class_type": "UniCacheBagelLoader", "inputs": {"checkpoint": "bagel-tiny"}},
    "3": {"class_type": "UniCacheTextToImage", "inputs": {"model": ["1", 0], "seed": 1, "prompt": "a"}},
    "5": {"class_type": "UniCacheKVReport", "inputs": {"report": ["3", 3]}},
}


def test_vary_sets_seed_and_prompt_on_task_nodes_only():
    g = work.vary(GRAPH, 2**64 - 1, "b")
    assert g["3"]["inputs"]["seed"] == 2**64 - 1 and g["3"]["inputs"]["prompt"] == "b"
    assert g["1"] == GRAPH["1"] and GRAPH["3"]["inputs"]["seed"] == 1  # the original is untouched
    assert work.vary(GRAPH, 5, None)["3"]["inputs"]["prompt"] == "a"


def test_seed_and_prompt_files(tmp_path):
    (tmp_path / "s").write_text("# seeds\n1\n0x10\n\n3\n")
    assert work.read_seeds(tmp_path / "s", 3) == [1, 16, 3]
    with pytest.raises(ValueError, match="has 3 seeds"):
        work.read_seeds(tmp_path / "s", 4)
    (tmp_path / "bad").write_text("-1\n")
    with pytest.raises(ValueError, match="outside"):
        work.read_seeds(tmp_path / "bad", 1)
    (tmp_path / "p").write_text("# c\none\n\ntwo\n")
    assert work.read_prompts(tmp_path / "p") == ["one", "two"]


def test_load_workflow_refuses_ui_format(tmp_path):
    (tmp_path / "ui.json").write_text(json.dumps({"nodes": [], "links": []}))
    with pytest.raises(ValueError, match="UI format"):
        work.load_workflow(tmp_path / "ui.json")
    (tmp_path / "api.json").write_text(json.dumps(GRAPH))
    assert work.load_workflow(tmp_path / "api.json") == GRAPH


def test_kv_saved_from_chart_data_then_text():
    chart = {"unicache_kv": [{"full_bytes": 1000, "steady_bytes": 400, "saved_bytes": 600, "reduction": 0.6}]}
    assert work.kv_saved([chart])[0] == 600
    assert work.kv_saved([{"unicache_kv": [{"full_bytes": 10, "steady_bytes": 4}]}])[0] == 6
    assert work.kv_saved([{"text": ["unicache / t2i: saved 7.5 KiB (59%)"]}])[0] == 7680
    assert work.kv_saved([{"unicache_kv": [{"saved_bytes": 0}]}])[0] == 0
    assert work.kv_saved([{}]) == (None, None)


@pytest.mark.parametrize(
    "args, msg",
    [
        (["--count", "0"], "--count"),
        (["--count", "1", "--host", "127.0.0.1:8188"], "give a URL"),
        (["--count", "2", "--seed-start", str(2**64 - 1)], "2\\*\\*64"),
        (["--count", "1", "--workers", "2"], "--workers only apply with --ray"),
        (["--count", "1", "--ray", "--gpus-per-worker", "-1"], "--gpus-per-worker must be within"),
        (["--count", "1", "--ray", "--cpus-per-worker", "0"], "--cpus-per-worker must be within"),
        (["--count", "1", "--poll", "0"], "--poll must be within"),
        (["--count", "1", "--timeout", "nan"], "--timeout must be > 0"),
    ],
)
def test_bad_arguments_exit_2(tmp_path, capsys, args, msg):
    wf = tmp_path / "wf.json"
    wf.write_text(json.dumps(GRAPH))
    argv = [str(wf), "--out", str(tmp_path / "o")] + args
    if "--host" not in args:
        argv += ["--host", "http://127.0.0.1:9"]
    assert cli.main(argv) == 2
    import re

    assert re.search(msg, capsys.readouterr().err)


def test_plain_path_needs_a_host(tmp_path, capsys):
    wf = tmp_path / "wf.json"
    wf.write_text(json.dumps(GRAPH))
    assert cli.main([str(wf), "--count", "1", "--out", str(tmp_path / "o")]) == 2
    assert "give at least one --host URL (or --ray" in capsys.readouterr().err


def test_unwritable_out_is_refused_before_any_run(tmp_path, capsys):
    wf = tmp_path / "wf.json"
    wf.write_text(json.dumps(GRAPH))
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "o"
    assert cli.main([str(wf), "--host", "http://127.0.0.1:9", "--count", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot write under --out" in err[0], err


def test_unreachable_host_is_refused_before_any_run(tmp_path, capsys):
    """No host answers at the start: one line naming the URL, exit 2, nothing run or written (issue 45.4; a host
    that goes away during the batch still fails its runs, tests/test_batch_hostile.py)."""
    wf = tmp_path / "wf.json"
    wf.write_text(json.dumps(GRAPH))
    argv = [str(wf), "--host", "http://127.0.0.1:9", "--out", str(tmp_path / "o"), *"--count 2 --timeout 30".split()]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tools.batch: --host http://127.0.0.1:9: "), err
    assert "start ComfyUI there" in err[0] and not (tmp_path / "o" / "summary.json").exists()
