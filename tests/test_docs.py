"""The docs as a user meets them: RESULTS.md is generated from the results files, pages stay short, links resolve.

No jax here: these read files only.
"""

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
DOC_PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location("report", BENCHMARKS / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_md_is_what_report_py_generates(report):
    """Nobody edits RESULTS.md by hand: `python benchmarks/report.py` rewrites it from benchmarks/results/."""
    page = (BENCHMARKS / "RESULTS.md").read_text()
    assert page == report.render(report.load()), "RESULTS.md is stale or hand-edited: run python benchmarks/report.py"
    assert page.count("\n") <= 250


def test_every_results_file_holds_the_schema(report):
    runs = report.load()
    assert runs
    for run in runs:
        assert set(run["machine"]) >= {"cpu", "isa", "cores"}, run["file"]
        assert all(isinstance(row, dict) for row in run["results"]), run["file"]


def test_report_shows_the_newest_run_per_benchmark_and_machine(report, tmp_path):
    machine = {"cpu": "a cpu", "isa": "avx2", "cores": 2}
    for name, date, ms in [("old", "2026-01-02", 9.5), ("new", "2026-02-01", 7.25)]:
        run = {"benchmark": "demo", "machine": machine, "date": date, "command": "python demo.py",
               "results": [{"case": "T=1", "ms": ms}]}  # fmt: skip
        (tmp_path / f"{name}.json").write_text(json.dumps(run))
    other = {"benchmark": "demo", "machine": {**machine, "cpu": "another cpu"}, "date": "2025-12-31",
             "command": "python demo.py", "results": [{"case": "T=1", "ms": 11.0}]}  # fmt: skip
    (tmp_path / "other.json").write_text(json.dumps(other))
    page = report.render(report.load(tmp_path))
    assert "| T=1 | 7.25 |" in page and "| T=1 | 11 |" in page
    assert "9.5" not in page


INTEL_VM = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 207
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: avx2 fma f16c avx512f avx512dq avx512bw avx512vl avx512vbmi avx512_vnni avx512_bf16 avx512_fp16 hypervisor

processor\t: 1
model name\t: not the first processor
"""
ZEN3 = """vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu avx avx2 fma f16c hypervisor
"""


def test_results_name_the_machine_from_cpuinfo(report):
    """A VM's "Intel(R) Xeon(R) Processor" says too little: the microarchitecture, the ISA extensions the kernels
    choose between and the L3 go into the results' machine."""
    assert report.describe_cpu(INTEL_VM, 260 << 20) == (
        "Intel Xeon (Emerald Rapids) VM (AVX-512 F/BW/DQ/VL/VBMI/VNNI/BF16/FP16, no AMX exposed; L3 260 MiB)"
    )
    assert report.describe_cpu(INTEL_VM.replace("avx512_fp16", "avx512_fp16 amx_tile"), None).endswith("FP16, AMX)")
    assert report.describe_cpu(ZEN3, 32 << 20) == "AMD EPYC (Zen 3) VM (AVX2, FMA, F16C, no AVX-512; L3 32 MiB)"
    assert report.describe_cpu(ZEN3.replace(": 1\n", ": 17\n"), None).startswith("AMD EPYC (Zen 4) VM")


def test_report_shows_fewer_rows_rather_than_a_longer_page(report, tmp_path):
    machine = {"cpu": "a cpu", "isa": "avx2", "cores": 2}
    for b in range(24):
        run = {"benchmark": f"bench{b:02d}", "machine": machine, "date": "2026-01-01", "command": "python x.py",
               "results": [{"case": i, "ms": i + 0.5} for i in range(10)]}  # fmt: skip
        (tmp_path / f"b{b}.json").write_text(json.dumps(run))
    page = report.render(report.load(tmp_path))
    assert page.count("\n") <= report.MAX_LINES
    shown = {int(n) for n in re.findall(r"the first (\d+) of 10 rows", page)}
    assert len(shown) == 1 and max(shown) < 8, shown  # the default 8 rows would not fit: fewer, the same in every table
    n = shown.pop()
    assert f"| {n - 1} | {n - 0.5:g} |" in page and f"| {n} | {n + 0.5:g} |" not in page


@pytest.mark.parametrize(
    "broken, message",
    [
        ({"machine": {"cpu": "x", "isa": "y", "cores": 1}, "date": "2026-01-01", "command": "c", "results": [{}]},
         "no 'benchmark'"),
        ({"benchmark": "b", "machine": {"cpu": "x"}, "date": "2026-01-01", "command": "c", "results": [{}]},
         "'machine' must hold"),
        ({"benchmark": "b", "machine": {"cpu": "x", "isa": "y", "cores": 1}, "date": "yesterday", "command": "c",
          "results": [{}]}, "ISO date"),
        ({"benchmark": "b", "machine": {"cpu": "x", "isa": "y", "cores": 1}, "date": "2026-01-01", "command": "c",
          "results": [{"nested": {"a": 1}}]}, r"results\[0\]\['nested'\]"),
    ],
)  # fmt: skip
def test_a_malformed_results_file_names_the_file_and_the_key(report, tmp_path, broken, message):
    (tmp_path / "bad.json").write_text(json.dumps(broken))
    with pytest.raises(ValueError, match=message) as info:
        report.load(tmp_path)
    assert "bad.json" in str(info.value)


def test_pages_stay_short():
    assert (ROOT / "README.md").read_text().count("\n") <= 200
    assert (ROOT / "docs" / "DESIGN.md").read_text().count("\n") <= 300


def test_readme_keeps_the_test_command_ci_runs():
    """.ci/run takes the fenced line after the marker: it must stay a pytest command."""
    lines = (ROOT / "README.md").read_text().split("\n")
    at = lines.index("<!-- test-command -->")
    assert lines[at + 1] == "```bash"
    assert "python -m pytest" in lines[at + 2]


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda p: p.name)
def test_user_docs_carry_no_dates_or_work_logs(page):
    """History lives in git; the docs say what is true now (CHANGELOG.md's release dates excepted)."""
    text = page.read_text()
    if page.name != "CHANGELOG.md":
        assert not re.findall(r"\b20\d\d-\d\d-\d\d\b", text)
    assert not re.findall(r"\bstop \d+|\bissue \d+|notes-\w+\.md", text, flags=re.IGNORECASE)


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
        if "://" in target:
            continue
        assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


def test_design_md_names_every_module_once():
    """The module tree is written in DESIGN.md only, and it names every module of the code."""
    design = (ROOT / "docs" / "DESIGN.md").read_text()
    sources = [p for folder in ("moejax", "pallas_kernels", "csrc") for p in sorted((ROOT / folder).rglob("*"))]
    missing = [
        str(path.relative_to(ROOT))
        for path in sources
        if path.suffix in {".py", ".cc", ".h", ".inc"}
        and "third_party" not in path.parts  # the vendored XLA FFI headers
        and path.name != "__init__.py"
        and not re.search(rf"(?<![\w.]){re.escape(path.name)}", design)  # decode.py is not tpu_decode.py
    ]
    assert not missing, f"DESIGN.md's module tree lacks {missing}"
