"""A read of data the store does not serve fails within the mount's `--deadline` on the kernel
path: once, not once per time the kernel asks the device again.

The kernel answers a failed read-ahead of a file's pages by reading the page the reader waits
for once more from the same task (read(2): once; a page fault: up to twice more), and each of
those device reads used to wait a deadline of its own: EIO after twice the deadline, a SIGBUS
after two or three times (fuse/failed_reads.py `FailedReads`, docs/design-notes.md). The
reader's own next read is a new read: it gets the data once the store answers again.

Real parts: a `weenv mount` daemon on the kernel path with the installed native device server,
a store served over HTTP (tests/store/http_server.py) behind the fault proxy
(tests/store/fault_proxy.py), which stalls every blob GET far beyond the deadline.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mounts import Mount, Mounter, publish

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "store"))
from fault_proxy import FaultProxy  # noqa: E402 - tests/store is not on the path by itself
from http_server import RangeHTTPServer  # noqa: E402

pytestmark = [pytest.mark.requires_fuse, pytest.mark.usefixtures("native_server")]

KIB, MIB = 1 << 10, 1 << 20
DEADLINE = 2.0  # --deadline of the mount
# A correctness bound, not a performance timing: a read the store does not serve must end
# within its deadline (plus a margin for scheduling); the bug this guards against ended it
# after twice (a page fault: three times) the deadline.
BOUND = 1.5 * DEADLINE
BLOBS = r"^GET .*/blobs/"
CONTENT = random.Random(7).randbytes(8 * MIB)
UNAVAILABLE = r"chunk [0-9a-f]{12} is unavailable"


@pytest.fixture
def stalled(tmp_path: Path, mounter: Mounter) -> Iterator[tuple[Mount, FaultProxy]]:
    """env:t (`big`: 8 MiB in 1 MiB chunks, and `small`) mounted on the kernel path from an
    HTTP store behind the fault proxy, with a cold cache; `small` read, then every blob GET
    stalls (the test clears the script when the store is to answer again)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "big").write_bytes(CONTENT)
    (src / "small").write_text("small\n")
    publish(tmp_path / "store", [src])
    with RangeHTTPServer(tmp_path / "store") as server, \
            FaultProxy(server.url, stall=3600) as proxy:
        mount = mounter.mount("env:t", proxy.url, extra=[  # type: ignore[arg-type]
            "--path", "kernel", "--hint", "none", "--deadline", str(DEADLINE)])
        assert (mount.mountpoint / "small").read_text() == "small\n"
        mount.expect_log_lines(UNAVAILABLE)
        proxy.set_script("t*", BLOBS)
        yield mount, proxy
        proxy.set_script("")


def test_a_read_fails_within_the_deadline_then_reads_again(
        stalled: tuple[Mount, FaultProxy]) -> None:
    mount, proxy = stalled
    at = 40 * 64 * KIB  # in the middle of a chunk no read has asked for
    with open(mount.mountpoint / "big", "rb", buffering=0) as f:
        started = time.monotonic()
        with pytest.raises(OSError) as info:
            os.pread(f.fileno(), 64 * KIB, at)
        took = time.monotonic() - started
        assert info.value.errno == errno.EIO
        assert took < BOUND, f"EIO after {took:.2f} s, deadline {DEADLINE:g} s"
        assert proxy.requests(code="t") >= 1

        # The same reader at once, the store answering again: a read of its own, not the
        # kernel's retry of the failed one, so it gets the data.
        proxy.set_script("")
        assert os.pread(f.fileno(), 64 * KIB, at) == CONTENT[at:at + 64 * KIB]


FAULT = """
import mmap, sys
with open(sys.argv[1], "rb") as f:
    m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    print(m[int(sys.argv[2])])
"""


def test_a_page_fault_fails_within_the_deadline(stalled: tuple[Mount, FaultProxy]) -> None:
    mount, _ = stalled
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", FAULT, str(mount.mountpoint / "big"),
                           str(6 * MIB + 12345)], capture_output=True, timeout=60)
    took = time.monotonic() - started
    assert done.returncode == -signal.SIGBUS, done
    assert took < BOUND, f"SIGBUS after {took:.2f} s, deadline {DEADLINE:g} s"
