"""The command line: demo and a tiny benchmark run end to end (in-process, small shapes)."""

import json

import pytest

from moejax.__main__ import main


def test_demo_prints_routing(capsys):
    assert main(["demo", "--family", "longcat_flash", "--decode-rows", "3", "--prefill-rows", "24"]) == 0
    out = capsys.readouterr().out
    assert "decode: T=3 plan=cpu_decode" in out and "prefill: T=24 plan=cpu_grouped" in out  # CPU default layout
    assert "union of selected experts" in out and "token 2: experts" in out


def test_demo_help_lists_families(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "deepseek_v4" in capsys.readouterr().out


def test_bench_quick_writes_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    args = ["bench", "--quick", "--dtypes", "float32", "--decode", "2", "--prefill", "40", "--repeats", "1"]
    main([*args, "--json", str(path)])
    rows = json.loads(path.read_text())["rows"]
    assert {(r["phase"], r["tokens"]) for r in rows} == {
        ("decode", "random"),
        ("decode", "repeated"),
        ("decode", "correlated"),
        ("prefill", "random"),
    }
    assert all(r["ms"] > 0 and 1 <= r["union"] <= 16 for r in rows)
    assert "mat-vec read" in capsys.readouterr().out
