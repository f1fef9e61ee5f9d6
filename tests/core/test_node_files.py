"""core/node_files.py `write_atomically`: a reader sees a whole copy or none, also when the
threads of one process write the same node copy at once (16 sandboxes opened together)."""

from __future__ import annotations

import threading
from pathlib import Path

from weenvfs.core.node_files import write_atomically


def test_threads_writing_one_copy_leave_one_whole_copy(tmp_path: Path) -> None:
    path = tmp_path / "manifests" / ("ab" * 32)
    versions = [bytes([n]) * (4 << 20) for n in range(8)]  # 4 MiB each: writes interleave
    start = threading.Barrier(len(versions))
    errors: list[BaseException] = []

    def write(data: bytes) -> None:
        start.wait()
        try:
            for _ in range(5):
                write_atomically(path, data)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=write, args=(data,)) for data in versions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert path.read_bytes() in versions
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temporary left
