"""Byte sizes as people write and read them (`512M`, `1.5GiB`, `4096`), in binary units.

Shared by every room's command line and reports, so that `--cache-size 10G` means the same
to `weenv mount` as `--memory 10G` to `weenv run`. Stdlib only.
"""

from __future__ import annotations

import argparse
import re

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?", re.IGNORECASE)
_SCALE = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def parse_size(text: str) -> int:
    """Bytes from `10G`, `512M`, `1.5GiB`, `64KB`, `4096` (K/M/G/T are powers of 1024)."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"invalid size {text!r} (e.g. 4096, 64K, 512M, 1.5G)")
    return int(float(match.group(1)) * _SCALE[match.group(2).upper()])


def size_arg(text: str) -> int:
    """`parse_size` for argparse `type=`: a bad size is a usage error naming the value."""
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def format_size(n: float) -> str:
    """`n` bytes with three significant digits in binary units: '0 B', '1.50 MiB'."""
    for unit in _UNITS:
        if abs(n) < 1024 or unit == _UNITS[-1]:
            return f"{int(n)} B" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def short_size(n: object) -> str:
    """`n` bytes for a narrow table column: two decimals from a GiB up (`1.50G`), whole MiB
    below (`512M`); `-` when `n` is not a number of bytes."""
    if not isinstance(n, int):
        return "-"
    return f"{n / _SCALE['G']:.2f}G" if n >= _SCALE["G"] else f"{n >> 20}M"
