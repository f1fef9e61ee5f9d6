"""The node's on/off environment variables (WEENV_MOUNTD, WEENV_NODE_RUN, WEENV_RECORD_HINTS,
WEENV_HINT_PACK, WEENV_SEED_HINT, WEENV_STANDBY, WEENV_TAG_GUESS, WEENV_SPARE,
WEENV_PUBLISHED_IMAGES), read one way everywhere.

Unset, empty, `on`, `1`, `yes` and `true` mean on; `off`, `0`, `no` and `false` mean off (any
case, spaces around ignored). Any other value is a mistake that must not pass as "on" (a
`WEENV_MOUNTD=of` once did): `switched_off` raises a one-line UsageError naming the variable.
native/weenv-launch.c reads WEENV_MOUNTD and WEENV_NODE_RUN with the same words and leaves a
value it does not know to Python, which then says what is wrong.

Must not: import anything beyond `os` at module level (a handed-over `weenv run` imports it:
tests/test_cli_dispatch.py).
"""

from __future__ import annotations

import os

OFF_WORDS = ("off", "0", "no", "false")
ON_WORDS = ("", "on", "1", "yes", "true")


def switched_off(name: str) -> bool:
    """Whether environment variable `name` turns its feature off (see the module); UsageError
    for a value that is neither on nor off."""
    wrong = problem(name)
    if wrong is not None:
        from weenvfs.errors import UsageError  # only when there is something to say

        raise UsageError(wrong)
    return os.environ.get(name, "").strip().lower() in OFF_WORDS


def problem(name: str) -> str | None:
    """What is wrong with switch `name`'s value in one line, or None (on, off or unset): for
    a caller that may not import weenvfs.errors (hand_over.py)."""
    value = os.environ.get(name, "").strip().lower()
    if value in OFF_WORDS or value in ON_WORDS:
        return None
    return f"${name} is {os.environ[name]!r}: set it to on or off (or unset it)"
