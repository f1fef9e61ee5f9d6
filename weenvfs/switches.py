"""The node's on/off environment variables (WEENV_MOUNTD, WEENV_NODE_RUN, WEENV_RECORD_HINTS,
WEENV_HINT_PACK, WEENV_SEED_HINT), read one way everywhere.

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
    value = os.environ.get(name, "").strip().lower()
    if value in OFF_WORDS:
        return True
    if value in ON_WORDS:
        return False
    from weenvfs.errors import UsageError  # only when there is something to say

    raise UsageError(f"${name} is {os.environ[name]!r}: set it to on or off (or unset it)")
