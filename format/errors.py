"""Errors of the format codec.

`FormatError` is raised for any malformed, truncated or unsupported encoded object; it names the
field and, where it helps, the expected and actual values. `DigestMismatch` is raised when bytes do
not hash to the digest they are addressed by. Both are plain exceptions: the codec has no I/O and
no dependency on the node side; callers translate them.
"""

from __future__ import annotations


class FormatError(ValueError):
    """The encoded object is malformed."""

    exit_code = 1

    def __init__(self, what: str, detail: str = "") -> None:
        super().__init__(f"{what}: {detail}" if detail else what)
        self.what = what


class UnsupportedFormat(FormatError):
    """The encoded object uses a version or an incompatible feature this reader lacks."""


class DigestMismatch(FormatError):
    """Bytes do not hash to their digest."""

    def __init__(self, what: str, expected: str, actual: str) -> None:
        super().__init__(what, f"digest mismatch: expected {expected[:12]}, got {actual[:12]}")
        self.expected = expected
        self.actual = actual
