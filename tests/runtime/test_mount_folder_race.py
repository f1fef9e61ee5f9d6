"""runtime/mounts.py `locked`: many processes' threads taking the lock of one shared mount
while teardowns remove its folder (as N environments starting at once on one group do, while
an earlier one's release or a failed mount removes the folder) never fail: a waiter whose
folder vanished starts over. Seen as FileExistsError from 32 `Environment.open` at once."""

from __future__ import annotations

import contextlib
import shutil
import threading
from pathlib import Path

import pytest

from weenvfs.runtime import mounts

KEY = "ab" * 32


def test_lockers_survive_teardowns_removing_the_folder(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(mounts.ROOT_ENV, str(tmp_path / "envs"))
    errors: list[BaseException] = []
    rounds = 300

    def worker(n: int) -> None:
        try:
            for i in range(rounds):
                with mounts.locked(KEY) as folder:
                    (folder / "holders").mkdir(exist_ok=True)
                    if (i + n) % 3 == 0:  # a teardown, as mounts._teardown ends one
                        shutil.rmtree(folder / "holders")
                        (folder / "lock").unlink()
                        with contextlib.suppress(OSError):  # a waiter's new lock file
                            folder.rmdir()
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
