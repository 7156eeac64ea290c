"""benchmarks/quant_accuracy.py: its metrics on hand-computed values, and one tiny table."""

import importlib.util
import pathlib

import numpy as np
import pytest

# benchmarks/ is a folder of scripts, not a package on the path: load the module from its file.
_spec = importlib.util.spec_from_file_location(
    "quant_accuracy", pathlib.Path(__file__).parents[1] / "benchmarks" / "quant_accuracy.py"
)
qa = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(qa)


def test_compare_metrics_by_hand():
    ref = np.array([[3.0, 4.0], [1.0, 0.0]])
    y = np.array([[3.0, 4.0], [1.0, 0.5]])  # row 1 off by 0.5: ||Δ||/||r|| = 0.5, |Δ|max / |r|max = 0.5/4
    m = qa.compare(y, ref)
    assert m["row_rel"] == pytest.approx(0.5)
    assert m["elem_rel"] == pytest.approx(0.125)
    assert m["cosine"] == pytest.approx(26 / (np.sqrt(26.25) * np.sqrt(26)))
    assert qa.compare(ref, ref) == {"cosine": pytest.approx(1.0), "row_rel": 0.0, "elem_rel": 0.0}


def test_draw_matrix_scale_and_outlier_channels():
    rng = np.random.default_rng(0)
    w = qa.draw_matrix(rng, "outlier-ch", (2, 200, 64))
    col = np.abs(w).mean(axis=(0, 2))  # per input channel
    assert np.sum(col > 5 * np.median(col)) == 2  # 1% of 200 channels, x20
    assert np.std(qa.draw_matrix(rng, "student-t3", (4, 256, 256))) == pytest.approx(1 / 16, rel=0.1)
    with pytest.raises(ValueError, match="weights 'uniform'"):
        qa.draw_matrix(rng, "uniform", (1, 2, 2))


def test_tiny_table():
    cfg = qa.qwen3_like(hidden=128, experts=4, top_k=2, intermediate=128)
    formats = (qa.FORMATS[0], qa.FORMATS[4])  # int8 sym g128 (one group per column here), int4 sym g32
    rows = qa.accuracy_table(cfg, tokens=8, formats=formats, weights=("normal",))
    by = {r["format"]: r for r in rows}
    assert list(by) == [qa.FLOOR, "int8 sym g128", "int4 sym g32"]
    assert by[qa.FLOOR]["memory"] == 2.0
    # The float32 floor < int8 < int4, and 8-bit stays close to the bf16 layer.
    assert by[qa.FLOOR]["row_rel"] < by["int8 sym g128"]["row_rel"] < by["int4 sym g32"]["row_rel"]
    assert by["int8 sym g128"]["cosine"] > 0.999
    table = qa.markdown(rows)
    assert table.count("\n") == 4 and "| int4 sym g32 |" in table
