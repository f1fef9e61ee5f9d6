"""The node's processes as tests look for them: `node_processes()` lists each live one (this
test's own process excepted) with its parent, name and command line, read from /proc; a
process that ends while it is read is skipped, and a zombie is not listed (its command line
is empty)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import NamedTuple


class Process(NamedTuple):
    pid: int
    parent: int
    name: str  # the kernel's short name (`comm`), as /proc/PID/stat has it
    command: bytes  # the command line, its NULs as spaces (a title set whole: as set)


def node_processes() -> Iterator[Process]:
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").rstrip(b" ")
        except OSError:  # it ended meanwhile
            continue
        name, rest = stat[stat.find(b"(") + 1:stat.rfind(b")")], stat[stat.rfind(b")") + 2:]
        if command:
            yield Process(int(entry), int(rest.split()[1]), name.decode(errors="replace"),
                          command)
