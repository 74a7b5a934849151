"""The batch client against fake hosts on 127.0.0.1 that answer badly (tests/fakehost.py).

Every malformed answer must end the run it concerns as failed (or error) with a one-line reason in the
summary, the next run must still succeed on the same host, and nothing may be written outside ``--out``."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
from cli_runs import with_flags
from fakehost import PNG, Answer, FakeHost, ok_history, ok_ws, text_frame

from tools.batch import cli, client

GRAPH = {
    "1": {"class_type": "UniCacheBagelLoader", "inputs": {"checkpoint": "bagel-tiny"}},
    "3": {"class_type": "UniCacheTextToImage", "inputs": {"model": ["1", 0], "seed": 1, "prompt": "a"}},
    "5": {"class_type": "UniCacheKVReport", "inputs": {"report": ["3", 3]}},
    "9": {"class_type": "SaveImage", "inputs": {"images": ["3", 0]}},
}


def first(bad, good=None):
    """An answer function: ``bad`` for the first prompt (number 0), the normal answer after it."""
    return lambda n, *rest: bad(*rest) if n == 0 else good(n, *rest)


def default_prompt(n):
    return Answer(200, {"prompt_id": f"p{n}", "number": n, "node_errors": {}})


def default_history(n, pid):
    return Answer(200, ok_history(pid))


def history_with(entry_for):
    """History whose first prompt's entry is ``entry_for(pid)`` (a whole JSON body)."""
    return {"history": first(lambda pid: Answer(200, entry_for(pid)), default_history)}


def outputs_with(outputs):
    return history_with(lambda pid: ok_history(pid, outputs))


def run_batch(tmp_path: Path, fake: FakeHost, count: int = 2, extra: tuple = ()) -> tuple[int, dict]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    wf = tmp_path / "wf.json"
    wf.write_text(json.dumps(GRAPH))
    out = tmp_path / "work" / "out"
    with fake:
        options = f"--count {count} --depth 1 --poll 0.05 --retries 0 --timeout 60".split()
        rc = cli.main(with_flags([str(wf), "--host", fake.url, "--out", str(out), *options], *extra))
    summary = json.loads((out / "summary.json").read_text())  # strict JSON: no NaN may reach it
    outside = [p for p in tmp_path.rglob("*") if p.is_file() and out not in p.parents and p != wf]
    assert outside == [], f"files written outside --out: {outside}"
    return rc, summary


def assert_one_line(reason: str) -> None:
    assert reason and "\n" not in reason and len(reason) <= client.REASON_CHARS, repr(reason)
    assert all(c.isprintable() for c in reason), repr(reason)


# Each case: (name, FakeHost overrides, status of run 0, text its error must contain).
NESTED = "[" * 100_000 + "]" * 100_000


def bad_prompt(answer: Answer) -> dict:
    return {"prompt": first(lambda: answer, default_prompt)}


def bad_view(answer: Answer) -> dict:
    return {"view": first(lambda query: answer, lambda n, query: Answer(200, PNG))}


def entry(status: object, **fields) -> Callable[[str], dict]:
    """A history body whose entry for the prompt has this ``status`` (and other fields)."""
    return lambda pid: {pid: {"status": status, **fields}}


OK = {"status_str": "success"}
VALIDATION = {
    "error": {"type": "prompt_outputs_failed_validation", "message": "Prompt outputs failed validation"},
    "node_errors": {
        "2": {
            "errors": [{"type": "value_bigger_than_max", "message": "Value 2.0 bigger than max", "details": "rho"}],
            "class_type": "UniCacheKVConfig",
        }
    },
}
EXEC_ERROR = [["execution_error", {"node_type": "X\x1b[2J", "node_id": ["3"], "exception_message": "a\nb\r\x00c"}]]
# fmt: off
CASES = [
    ("prompt not json", bad_prompt(Answer(200, b"<html>hello</html>")), "failed", "not JSON"),
    ("prompt deep json", bad_prompt(Answer(200, NESTED.encode())), "failed", "not JSON"),
    ("prompt list", bad_prompt(Answer(200, [])), "failed", "no usable prompt_id"),
    ("prompt no id", bad_prompt(Answer(200, {"number": 0})), "failed", "no usable prompt_id"),
    ("prompt id int", bad_prompt(Answer(200, {"prompt_id": 7})), "failed", "no usable prompt_id"),
    ("prompt id path", bad_prompt(Answer(200, {"prompt_id": "../../x"})), "failed", "no usable prompt_id"),
    ("prompt id long", bad_prompt(Answer(200, {"prompt_id": "a" * 5000})), "failed", "no usable prompt_id"),
    ("refusal string error", bad_prompt(Answer(400, {"error": "bad\ngraph", "node_errors": []})), "failed",
     "HTTP 400): bad graph"),
    ("refusal odd shapes", bad_prompt(Answer(400, {"error": {"message": 5}, "node_errors": {"3": 1}})),
     "failed", "node 3"),
    ("refusal comfy shape", bad_prompt(Answer(400, VALIDATION)), "failed",
     "node 2 (UniCacheKVConfig): Value 2.0 bigger than max rho"),
    ("refusal list body", bad_prompt(Answer(400, [1, 2])), "failed", "HTTP 400"),
    ("prompt html 500", bad_prompt(Answer(500, b"<html>\n<b>Internal\x1b[31m</b>\n</html>")), "failed",
     "HTTP 500"),
    ("prompt 404 empty", bad_prompt(Answer(404, b"")), "failed", "HTTP 404"),
    ("prompt redirect", bad_prompt(Answer(302, b"", headers={"Location": "http://127.0.0.1:9/x"})), "failed",
     "HTTP 302"),
    ("prompt not http", bad_prompt(Answer(raw=b"HELLO THERE\r\n\r\n")), "failed", "malformed HTTP answer"),
    ("history 500", {"history": first(lambda pid: Answer(500, b"oops"), default_history)}, "failed",
     "answered HTTP 500"),
    ("history not json", {"history": first(lambda pid: Answer(200, b"{"), default_history)}, "failed",
     "not JSON"),
    ("history list", history_with(lambda pid: [pid]), "failed", "not a JSON object"),
    ("history entry str", history_with(lambda pid: {pid: "done"}), "failed", "the entry is str"),
    ("history status str", history_with(entry("ok", outputs={})), "failed", "'status' is 'ok'"),
    ("history status odd", history_with(entry({"status_str": "maybe"})), "failed", "status_str 'maybe'"),
    ("history status bool", history_with(entry({"status_str": True})), "failed", "status_str True"),
    ("outputs list", history_with(entry(OK, outputs=[1])), "failed", "'outputs' is [1]"),
    ("output str", outputs_with({"9": "x"}), "failed", "output of node '9' is not an object"),
    ("images dict", outputs_with({"9": {"images": {"a": 1}}}), "failed", "'images' is {'a': 1}, not list"),
    ("image str", outputs_with({"9": {"images": ["a.png"]}}), "failed", "image is str"),
    ("filename int", outputs_with({"9": {"images": [{"filename": 7}]}}), "failed",
     "'filename' is 7, not str"),
    ("subfolder list", outputs_with({"9": {"images": [{"filename": "a.png", "subfolder": []}]}}), "failed",
     "'subfolder' is []"),
    ("text dict", outputs_with({"5": {"text": [{"a": 1}]}}), "failed", "a text item is dict"),
    ("text str", outputs_with({"5": {"text": "abc"}}), "failed", "'text' is 'abc', not list"),
    ("too many files", outputs_with({"9": {"images": [{"filename": f"{i}.png"} for i in range(300)]}}),
     "failed", "more than 256 output files"),
    ("view 404", bad_view(Answer(404, b"404: Not Found")), "failed",
     "/view 'unicache_00001_.png' answered HTTP 404"),
    ("view cut short", bad_view(Answer(raw=b"HTTP/1.0 200 OK\r\nContent-Length: 1000\r\n\r\nabc")), "failed",
     "answer cut short (3 of 1000 bytes)"),
    ("error no details", history_with(entry({"status_str": "error", "messages": "x"})), "error",
     "without details"),
    ("error escapes", history_with(entry({"status_str": "error", "messages": EXEC_ERROR})), "error",
     "X [2J (node ['3']): ?: a b c"),
]
# fmt: on


@pytest.mark.parametrize("name, overrides, status, reason", CASES, ids=[c[0] for c in CASES])
def test_malformed_answer_fails_one_run_and_the_batch_goes_on(tmp_path, name, overrides, status, reason):
    rc, summary = run_batch(tmp_path, FakeHost(**overrides))
    bad, good = summary["runs"]
    assert rc == 1 and bad["status"] == status, bad
    assert reason in bad["error"], bad["error"]
    assert_one_line(bad["error"])
    assert good["status"] == "success" and good["error"] is None, good
    assert good["kv_bytes_saved"] == 600 and len(good["outputs"]) == 3, good


def test_answers_over_the_size_caps_fail_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(client, "MAX_JSON_BYTES", 4096)
    monkeypatch.setattr(client, "MAX_FILE_BYTES", 1024)
    big_view = {"view": first(lambda q: Answer(200, b"x" * 5000), lambda n, q: Answer(200, PNG))}
    rc, summary = run_batch(tmp_path / "view", FakeHost(**big_view))
    assert "answer larger than 1024 bytes" in summary["runs"][0]["error"]
    assert summary["runs"][1]["status"] == "success"
    big_history = history_with(lambda pid: {pid: {"status": {"status_str": "success"}, "pad": "y" * 10_000}})
    rc, summary = run_batch(tmp_path / "history", FakeHost(**big_history))
    assert "answer larger than 4096 bytes" in summary["runs"][0]["error"]
    assert summary["runs"][1]["status"] == "success"


@pytest.mark.parametrize(
    "kv",
    [
        {"saved_bytes": math.nan},
        {"full_bytes": math.inf, "steady_bytes": 1},
        {"saved_bytes": "600"},
        {"saved_bytes": True},
        {"saved_bytes": 10**30},
        [[[[[[[[{"saved_bytes": None}]]]]]]]],
        "x" * 100,
    ],
)
def test_odd_kv_numbers_give_no_figure_and_strict_json(tmp_path, kv):
    outputs = {"5": {"unicache_kv": kv}, "9": {"images": [{"filename": "a.png"}]}}
    rc, summary = run_batch(tmp_path, FakeHost(**outputs_with(outputs)), count=1)
    run = summary["runs"][0]
    assert rc == 0 and run["status"] == "success", run
    assert run["kv_bytes_saved"] is None and run["kv_summary"] is None, run


def test_deeply_nested_report_data_is_stored_or_refused_in_one_line(tmp_path):
    deep: object = 1
    for _ in range(900):
        deep = [deep]
    rc, summary = run_batch(tmp_path, FakeHost(**outputs_with({"5": {"unicache_kv": deep}})))
    bad, good = summary["runs"]
    assert bad["status"] in ("success", "failed"), bad
    if bad["status"] == "failed":
        assert "cannot be stored" in bad["error"] and assert_one_line(bad["error"]) is None
    assert good["status"] == "success"


HOSTILE_NAMES = [
    ("/../../x", "../../../escape.png"),
    ("..", ".."),
    (".", "."),
    ("", ""),
    ("/abs", "/etc/passwd"),
    ("n\x00id", "a\x00b.png"),
    ("9", "..\\..\\win.png"),
    ("9", "x" * 5000 + ".png"),
    ("a/b", "same.png"),
    ("a_b", "same.png"),
    ("~", "~/.bashrc"),
    ("9", ".hidden"),
    ("9", "con:"),
    ("\u202e", "\u202egnp.exe"),
]


def test_hostile_node_ids_and_file_names_stay_inside_out(tmp_path):
    outputs = {nid: {"images": []} for nid, _ in HOSTILE_NAMES}
    for nid, filename in HOSTILE_NAMES:
        outputs[nid]["images"].append({"filename": filename, "subfolder": "../..", "type": "../output"})
    outputs["../../t"] = {"text": ["hello"], "unicache_kv": {"saved_bytes": 1}}
    rc, summary = run_batch(tmp_path, FakeHost(**outputs_with(outputs)), count=1)
    run = summary["runs"][0]
    assert rc == 0 and run["status"] == "success", run
    run_dir = (tmp_path / "work" / "out" / "0000").resolve()
    written = [Path(p) for p in run["outputs"]]
    assert len(written) == len(HOSTILE_NAMES) + 2 and len(set(written)) == len(written), written
    for path in written:
        assert path.resolve().parent == run_dir and path.read_bytes(), path
        assert len(path.name) <= 160 and not path.name.startswith(".") and "\x00" not in path.name, path.name
    assert sorted(p.name for p in run_dir.iterdir()) == sorted([p.name for p in written] + ["history.json"])
    assert not (tmp_path / "x").exists() and not (tmp_path / "escape.png").exists()


def test_websocket_messages_of_other_shapes_are_skipped(tmp_path):
    # fmt: off
    junk = [b"\x89\x00", text_frame(b"\x00\x01binary", opcode=2), text_frame("not json"),
            text_frame("[1, 2]"),
            text_frame('{"type": "progress", "data": []}'),
            text_frame('{"type": "progress", "data": {"prompt_id": ["x"]}}'),
            text_frame('{"type": "progress", "data": {"prompt_id": "p0", "value": "a", "max": 3}}'),
            text_frame('{"type": "progress", "data": {"prompt_id": "p0", "value": NaN, "max": Infinity}}'),
            text_frame('{"type": "progress", "data": {"prompt_id": "p0", "value": 5, "max": 0}}'),
            text_frame('{"type": "executing", "data": {"node": null, "prompt_id": {}}}'),
            text_frame("[" * 50_000), text_frame(b"\xff\xfe invalid utf-8")]
    # fmt: on

    def ws(n, pid):
        return junk + ok_ws(pid) if n == 0 else ok_ws(pid)

    rc, summary = run_batch(tmp_path, FakeHost(ws=ws))
    assert rc == 0 and [r["status"] for r in summary["runs"]] == ["success", "success"], summary


@pytest.mark.parametrize(
    "frames",
    [
        [b"\xff\x05hello"],  # reserved bits and an unknown opcode
        [text_frame(b"", opcode=8)],  # the host closes the websocket
        [b"\x81\x7f" + (2**62).to_bytes(8, "big")],  # announces a frame of 4 EiB, then nothing
    ],
    ids=["bad frame", "close", "huge length"],
)
def test_broken_websocket_falls_back_to_history(tmp_path, frames):
    rc, summary = run_batch(tmp_path, FakeHost(ws=lambda n, pid: frames if n == 0 else ok_ws(pid)))
    assert rc == 0 and [r["status"] for r in summary["runs"]] == ["success", "success"], summary


def test_host_without_websocket_is_followed_by_history(tmp_path):
    rc, summary = run_batch(tmp_path, FakeHost(websocket=False))
    assert rc == 0 and summary["succeeded"] == 2, summary


def test_prompt_that_never_finishes_fails_at_the_deadline(tmp_path):
    never = {"history": lambda n, pid: Answer(200, {}), "ws": lambda n, pid: []}
    rc, summary = run_batch(tmp_path, FakeHost(**never), count=1, extra=("--timeout", "2"))
    run = summary["runs"][0]
    assert rc == 1 and run["status"] == "failed" and "deadline" in run["error"], run


def test_host_that_hangs_up_loses_its_runs_to_a_good_host(tmp_path):
    """A host that closes every /prompt connection unanswered is gone: its runs finish on the other host."""
    wf = tmp_path / "wf.json"
    wf.write_text(json.dumps(GRAPH))
    out = tmp_path / "out"
    with FakeHost(prompt=lambda n: Answer(raw=b"")) as bad, FakeHost() as good:
        hosts = ["--host", bad.url, "--host", good.url]
        rc = cli.main([str(wf), *hosts, "--out", str(out), *"--count 4 --depth 1 --poll 0.05".split()])
    summary = json.loads((out / "summary.json").read_text())
    assert rc == 0 and summary["succeeded"] == 4, summary
    assert {r["host"] for r in summary["runs"]} == {good.url}
    assert bad.prompts >= 1 and good.prompts == 4


def test_client_streams_progress_then_fetches_outputs():
    """As in ComfyUI, the history entry appears only after the progress messages (here: at the 2nd look)."""
    events, looks = [], []

    def history(n, pid):
        looks.append(pid)
        return Answer(200, ok_history(pid) if len(looks) > 1 else {})

    with FakeHost(history=history) as fake:
        outcome = client.HostClient(fake.url, request_timeout=5, poll=0.05).execute(GRAPH, events.append, 10)
    assert events == [{"event": "submitted", "prompt_id": "p0"}] + [
        {"event": "progress", "value": v, "max": 3} for v in (1, 2, 3)
    ]
    assert outcome.status == "success" and outcome.images == [("9", "unicache_00001_.png", PNG)]
    assert outcome.texts == [("5", "unicache: saved 600 B")] and list(outcome.kv) == ["5"]


def test_refused_connection_is_host_gone():
    with FakeHost() as fake:
        url = fake.url
    with pytest.raises(client.HostGone):
        client.HostClient(url, request_timeout=2).execute(GRAPH, None, 5)


@pytest.mark.parametrize("runs, hosts", [(0, ["http://127.0.0.1:9"]), (1, [])])
def test_a_batch_with_nothing_to_run_or_nowhere_to_run_it_returns_at_once(tmp_path, runs, hosts):
    """The batch waits for an event, not a clock: with no run (or no host) that event must already be set,
    or the call would sit until its deadline (an hour by default)."""
    import threading

    from tools.batch.hosts import run_on_hosts
    from tools.batch.work import Run

    batch = [Run(index=i, seed=i, prompt_text=None) for i in range(runs)]
    call = threading.Thread(target=run_on_hosts, args=({}, batch, tmp_path, hosts), daemon=True)
    call.start()
    call.join(timeout=30)
    assert not call.is_alive()
    assert all(run.status == "failed" for run in batch)
