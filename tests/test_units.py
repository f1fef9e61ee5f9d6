"""Byte sizes as every command line spells them (weenvfs/units.py)."""

from __future__ import annotations

import argparse

import pytest

from weenvfs.units import format_size, parse_size, size_arg

MIB = 1 << 20


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("4096", 4096),
        ("64K", 65536),
        ("8k", 8192),
        ("1M", MIB),
        ("1MiB", MIB),
        ("3kb", 3072),
        ("2 MB", 2 * MIB),
        ("1.5GiB", 3 << 29),
        ("10g", 10 << 30),
        ("2gb", 2 << 30),
        ("1T", 1 << 40),
        (" 512M ", 512 * MIB),
    ],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "lots", "-1", "1X", "1.5.2G", "M"])
def test_bad_sizes_are_refused_naming_the_value(text: str) -> None:
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(text)
    with pytest.raises(argparse.ArgumentTypeError, match=repr(text)[1:-1] or "invalid"):
        size_arg(text)


def test_format_size() -> None:
    assert [format_size(n) for n in (0, 5, 2048, 1536 * 1024, 3 << 30)] == [
        "0 B",
        "5 B",
        "2 KiB",
        "1.5 MiB",
        "3 GiB",
    ]
