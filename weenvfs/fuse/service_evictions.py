"""The evictions of the node's shared mounts that the node service runs (fuse/mountd.py).

A sandbox that released its mounts asks for an eviction (`mountd.request_eviction`, a request
of kind EVICT) instead of waiting for daemons to exit; the server forks HOUSEKEEPING with the
client's environment (its mounts folder and bounds: runtime/mounts.py). `Evictions` runs one
at a time per environment; a request arriving while one runs makes one more run after it.
The server also forks HOUSEKEEPING on its own every HOUSEKEEPING_EVERY seconds (the idle
bounds).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import daemon
from .service_forks import fork_task

# What the server runs (in a forked child) for an eviction: evict the warm shared mounts past
# their idle timeout or over the node's bounds (runtime/mounts.py). The CLI runs it, so this
# package never imports the runtime.
HOUSEKEEPING = ("mounts", "evict", "--expired", "--quiet")


_EnvKey = tuple[tuple[str, str], ...]  # an eviction's WEENV_ variables, sorted


class Evictions:
    """The evictions clients asked for (EVICT): one process at a time per environment (its
    WEENV_ variables: mounts folder and bounds); a request while one runs makes one more
    run after it, which sees what was released since the running one listed the mounts.
    (A plain class: see mountd.py `_Listening`.)"""

    def __init__(self, held: tuple[Any, ...], run: Callable[[list[str]], int]) -> None:
        self.held, self.run = held, run
        self.running: dict[_EnvKey, tuple[int, str]] = {}
        self.waiting: dict[_EnvKey, dict[str, Any]] = {}

    @staticmethod
    def key(request: dict[str, Any]) -> _EnvKey:
        """The environment an eviction request is for (its WEENV_ variables); TypeError,
        ValueError or KeyError for a bad request, so that it fails in the answer, before
        the server says ok."""
        if not isinstance(request.get("env"), dict):
            raise TypeError("the request's env is not an object")
        int(request["umask"])
        return tuple(sorted((str(k), str(v)) for k, v in request["env"].items()
                            if str(k).startswith("WEENV_")))

    def ask(self, key: _EnvKey, request: dict[str, Any], held: tuple[Any, ...]) -> None:
        """Start the eviction of `request` (for environment `key`) now (its child closes
        `held`, the connection too) or after the one running for the same environment."""
        if key in self.running and self._still_running(key):
            self.waiting[key] = request
        else:
            self._start(key, request, held)

    def poll(self) -> bool:
        """Start the waiting evictions whose predecessor ended; whether any still wait."""
        for key in [k for k in self.waiting if not self._still_running(k)]:
            self._start(key, self.waiting.pop(key), self.held)
        return bool(self.waiting)

    def _still_running(self, key: _EnvKey) -> bool:
        pid, started = self.running.get(key, (0, ""))
        if pid and started and daemon.start_time(pid) == started:
            return True
        self.running.pop(key, None)
        return False

    def _start(self, key: _EnvKey, request: dict[str, Any],
               held: tuple[Any, ...]) -> None:
        pid = fork_task(list(HOUSEKEEPING), held, self.run, request)
        if pid:
            self.running[key] = (pid, daemon.start_time(pid))
