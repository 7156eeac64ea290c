"""The command line (demo) and the plans benchmark script, end to end (in-process, small shapes)."""

import json

import pytest
from benchmark_scripts import load

from moejax.__main__ import main
from moejax.backends import native as native_cpu


def test_demo_prints_routing(capsys):
    assert main(["demo", "--family", "longcat_flash", "--decode-rows", "3", "--prefill-rows", "24"]) == 0
    out = capsys.readouterr().out
    # CPU default layout: the native kernels where built, else the CPU plans
    decode, prefill = ("native", "native") if native_cpu.available() else ("cpu_decode", "cpu_grouped")
    assert f"decode: T=3 plan={decode}" in out and f"prefill: T=24 plan={prefill}" in out
    assert "union of selected experts" in out and "token 2: experts" in out


def test_demo_help_lists_families(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "deepseek_v4" in capsys.readouterr().out


def test_bench_quick_writes_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    args = ["--quick", "--dtypes", "float32", "--decode", "2", "--prefill", "40", "--repeats", "1"]
    assert load("plans_bench").main([*args, "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert {(r["phase"], r["tokens"]) for r in rows} == {
        ("decode", "random"),
        ("decode", "repeated"),
        ("decode", "correlated"),
        ("prefill", "random"),
    }
    assert all(r["ms"] > 0 and 1 <= r["union"] <= 16 for r in rows)
    assert "mat-vec read" in capsys.readouterr().out
