"""Pages written ahead in a fork (weenvfs/fuse/spare_pages.py): a fork that learned which
pages it wrote tells the next fork, which faults exactly those in before it needs them; no
byte of memory changes, and a file that is stale, damaged or from another layout costs
nothing but the copies.

Real forks of this process and the kernel's own counters (minor faults from getrusage, the
private dirty bytes of /proc/self/smaps_rollup); no node service.
"""

from __future__ import annotations

import hashlib
import os
import resource
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from weenvfs.fuse import spare_pages

# A heap of ~5k pages (made by the `heap` fixture), touched in the forks as a run touches
# the service's objects.
OBJECTS: list[list[int]] = []
BLOCK = bytearray()


@pytest.fixture(scope="module", autouse=True)
def heap() -> None:
    OBJECTS.extend(list(range(20)) for _ in range(60_000))
    BLOCK.extend(os.urandom(8 << 20))


def _touch() -> None:
    for item in OBJECTS[::3]:
        len(item)  # a reference count written: the page is copied
    for at in range(0, len(BLOCK), 3 * spare_pages.PAGE):
        BLOCK[at] = BLOCK[at]


def _in_fork(body: Callable[[], str]) -> str:
    """`body()` in a forked child; what it returned."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            os.write(write, body().encode())
        except BaseException as error:  # noqa: BLE001 - reported to the parent
            os.write(write, f"error {error!r}".encode())
            code = 1
        os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        said = f.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, said
    return said


def _faults_of_touch() -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    _touch()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def _digest() -> str:
    return hashlib.sha256(BLOCK + repr(OBJECTS[::997]).encode()).hexdigest()


@pytest.fixture
def learned(tmp_path: Path) -> Path:
    """The pages a fork wrote while touching the heap, learned by it."""
    path = tmp_path / "pages"

    def learn() -> str:
        _touch()
        return str(spare_pages.learn(str(path)))

    assert _in_fork(learn) == "True"
    return path


def test_a_fork_that_wrote_ahead_takes_few_faults_and_sees_the_same_bytes(
        learned: Path) -> None:
    pages = sum(count for _, count in spare_pages.read_ranges(str(learned)))
    assert pages > 1000, pages  # the touched pages are among those the learner wrote
    digest = _digest()

    def plain() -> str:
        return str(_faults_of_touch())

    def ahead() -> str:
        done = spare_pages.prefault(str(learned))
        return f"{done} {_faults_of_touch()} {_digest()}"

    without = int(_in_fork(plain))
    done, with_, seen = _in_fork(ahead).split()
    assert int(done) >= pages * 0.9
    assert without > 1000 and int(with_) < without / 5, (without, with_)
    assert seen == digest  # writing ahead changed no byte


@pytest.mark.parametrize("content", [
    b"",
    b"\x00" * 7,  # shorter than a range
    os.urandom(4096),  # addresses nothing maps, or not page-aligned
    struct.pack("=QQ", 4096, 1 << 40),  # the first page, far too many pages
    struct.pack("=QQ", 0xFFFF_FFFF_F000, 10),  # past the end of user memory
])
def test_a_damaged_file_changes_nothing(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "pages"
    path.write_bytes(spare_pages.SERVICE + content)
    digest = _digest()
    assert _in_fork(lambda: f"{spare_pages.prefault(str(path))} {_digest()}").split()[1] \
        == digest
    assert spare_pages.prefault(str(tmp_path / "missing")) == 0


def test_another_services_file_is_ignored_and_learned_again(
        learned: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A service started again (another memory layout) finds its predecessor's file, young:
    its spare writes nothing ahead, and its run learns at once."""
    monkeypatch.setattr(spare_pages, "PAGES_FILE", str(learned))
    data = learned.read_bytes()
    assert spare_pages.read_ranges(str(learned))
    learned.write_bytes(os.urandom(len(spare_pages.SERVICE)) + data[len(spare_pages.SERVICE):])
    assert spare_pages.read_ranges(str(learned)) == []
    assert _in_fork(lambda: str(spare_pages.prefault(str(learned)))) == "0"

    def spare_then_run() -> str:
        return f"{spare_pages.prefault_if_learned()} {spare_pages.learn_if_due()}"

    assert _in_fork(spare_then_run) == "0 True"
    assert spare_pages.read_ranges(str(learned))


def test_a_run_that_wrote_ahead_never_learns_and_a_due_file_is_not_written_ahead(
        learned: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spare_pages, "PAGES_FILE", str(learned))

    def age() -> None:
        old = learned.stat().st_mtime - spare_pages.LEARN_EVERY - 1
        os.utime(learned, (old, old))

    def spare_then_run() -> str:
        done = spare_pages.prefault_if_learned()
        _touch()
        age()  # due by the run's end: still not learned where pages were written ahead
        return f"{done} {spare_pages.learn_if_due()}"

    done, learnt = _in_fork(spare_then_run).split()
    assert int(done) > 0 and learnt == "False"
    aged = learned.stat().st_mtime_ns
    done, learnt = _in_fork(spare_then_run).split()  # due: its run learns instead
    assert int(done) == 0 and learnt == "True"
    assert learned.stat().st_mtime_ns != aged
