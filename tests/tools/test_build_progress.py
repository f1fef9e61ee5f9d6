"""The progress reporter: bar on a TTY, periodic lines otherwise, silence when quiet.

A fake clock drives time, so nothing sleeps and nothing depends on the machine's speed.
"""

from __future__ import annotations

import io

import pytest

from weenvfs.tools.progress import Progress, format_size


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_lines_mode_prints_periodically_with_total():
    out, clock = io.StringIO(), Clock()
    progress = Progress(out, clock=clock, interval=10)
    assert progress.mode == "lines"
    progress.begin("reading", total=4 << 20)
    progress.update(1 << 20)  # too soon: nothing
    clock.now += 10
    progress.update(1 << 20)
    clock.now += 2
    progress.end()
    lines = out.getvalue().splitlines()
    assert lines == [
        "reading: 2 MiB / 4 MiB (50%), 205 KiB/s, 10.0 s",
        "reading: 2 MiB / 4 MiB (50%), 171 KiB/s, 12.0 s",
    ]


def test_bar_mode_redraws_in_place_and_handles_unknown_total():
    out, clock = Tty(), Clock()
    progress = Progress(out, clock=clock)
    assert progress.mode == "bar"
    progress.begin("reading")
    clock.now += 1
    progress.update(3000)
    progress.set_total(6000)
    clock.now += 1
    progress.update(3000)
    progress.end()
    text = out.getvalue()
    assert text.startswith("\r\x1b[Kreading: 2.93 KiB, 2.93 KiB/s, 1.0 s")
    assert text.endswith(
        "\r\x1b[K[########################] reading: 5.86 KiB / 5.86 KiB "
        "(100%), 2.93 KiB/s, 2.0 s\n"
    )


def test_quiet_prints_nothing_and_counts_units():
    out = io.StringIO()
    with Progress(out, "quiet") as progress:
        progress.begin("files", unit="files")
        progress.update(3)
        assert progress.done == 3
    assert out.getvalue() == ""


def test_unit_and_new_phase_ends_the_previous_one():
    out, clock = io.StringIO(), Clock()
    progress = Progress(out, "lines", clock=clock)
    progress.begin("a", 10, unit="files")
    progress.update(10)
    progress.begin("b")
    progress.end()
    assert out.getvalue().splitlines()[0].startswith("a: 10 files / 10 files (100%)")
    assert out.getvalue().splitlines()[1].startswith("b: 0 B")


def test_bad_mode():
    with pytest.raises(ValueError):
        Progress(io.StringIO(), "loud")


@pytest.mark.parametrize(
    ("n", "text"), [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (5 << 30, "5 GiB")]
)
def test_format_size(n, text):
    assert format_size(n) == text
