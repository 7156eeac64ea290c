"""The progress bar of benchmarks/plans_bench.py: drawn on a terminal, silent on a pipe or file."""

import io

from benchmark_scripts import load

ProgressBar = load("plans_bench").ProgressBar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_redraws_one_line_on_a_terminal():
    stream = _Terminal()
    bar = ProgressBar(4, stream=stream, width=8)
    bar.update(0, "first case")
    bar.update(2, "third case")
    text = stream.getvalue()
    assert text.startswith("\r[........] 0/4  0:00 elapsed  first case")
    assert "\r[####....] 2/4  0:00 elapsed, ~0:00 left  third case" in text
    assert "\n" not in text  # redrawn in place
    bar.close()
    assert stream.getvalue().endswith("\r")
    assert stream.getvalue().rsplit("\r", 2)[-2].strip() == ""  # the bar is blanked out


def test_progress_bar_is_silent_when_not_a_terminal():
    stream = io.StringIO()  # a pipe, a file, a CI log
    bar = ProgressBar(3, stream=stream)
    for i in range(3):
        bar.update(i, f"case {i}")
    bar.close()
    assert stream.getvalue() == ""
