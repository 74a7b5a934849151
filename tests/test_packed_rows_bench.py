"""benchmarks/packed_rows.py: the packed-row pair runs, reports both stores and refuses a bad row count."""

from __future__ import annotations

import json

import pytest

from benchmarks.packed_rows import main


def test_the_pair_reports_every_dtype_and_query_count(tmp_path):
    out = tmp_path / "pair.json"
    main(["--rows", "512", "--repeats", "1", "--json", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert {(r["dtype"], r["queries"]) for r in rows} == {(d, q) for d in ("float32", "bfloat16") for q in (256, 1)}
    for r in rows:
        assert r["rows"] == 512 and r["packed_seconds"] > 0 and r["full_seconds"] > 0
        assert r["packed_bytes"] * 4 < r["full_bytes"]  # 2-bit rows: the bytes really shrink


def test_a_row_count_below_one_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--rows", "0"])
    assert exc.value.code == 2
    assert "--rows must be a positive row count, got 0" in capsys.readouterr().err
