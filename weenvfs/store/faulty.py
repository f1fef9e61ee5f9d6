"""Fault injection in front of a real store, for tests (borg's `ChunkerFailing` style).

Owns: turning a script string into failures of successive store calls, and counting calls.
Must not: be used outside tests and benchmarks, or fake a store on its own (it always wraps a
real one).

Each store call (get, get_range, put, put_file, exists, size, list, delete, check) consumes
one character of the script, in call order across all threads:

    g  pass the call through
    E  raise StoreUnavailable(temporary=True)
    P  raise StoreUnavailable(temporary=False)
    M  raise ObjectMissing
    C  pass through, then flip one byte of what get/get_range return (others: pass through)
    S  sleep `delay` seconds, then pass through

When the script runs out, calls pass through; a script ending in `*` repeats its last code
forever instead (`"gE*"`: one success, then every call fails).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from weenvfs.errors import ObjectMissing, StoreUnavailable
from weenvfs.store.base import Store

METHODS = frozenset(
    {"get", "get_range", "put", "put_file", "exists", "size", "list", "delete", "check"}
)
CODES = frozenset("gEPMCS")


def _parse_script(script: str) -> tuple[str, bool]:
    """Split a script into its codes and whether the last one repeats."""
    repeat = script.endswith("*")
    codes = script[:-1] if repeat else script
    bad = set(codes) - CODES
    if bad or (repeat and not codes):
        raise ValueError(
            f"bad fault script {script!r}: use only {''.join(sorted(CODES))}, "
            "optionally ending in '*' after at least one code"
        )
    return codes, repeat


def corrupt(data: bytes) -> bytes:
    """Return `data` with its middle byte inverted (b"\\x00" for empty data)."""
    if not data:
        return b"\x00"
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :]


class FaultyStore(Store):
    """`inner` with faults injected by `script` (see the module docstring).

    `overrides` maps a method name to a callable that replaces the call to `inner` when the
    script lets the call through, e.g. `FaultyStore(inner, get_range=fn)` where
    `fn(key, offset, length)` returns bytes or raises. `calls` counts calls per method
    (faulted ones included); `injected` counts the codes applied.
    """

    def __init__(
        self,
        inner: Store,
        script: str = "",
        *,
        delay: float = 0.05,
        **overrides: Callable[..., Any],
    ) -> None:
        unknown = set(overrides) - METHODS
        if unknown:
            raise TypeError(f"FaultyStore has no method(s) {sorted(unknown)} to override")
        self.inner = inner
        self.cheap_requests = inner.cheap_requests and not (script or overrides)  # faults: dear
        self.delay = delay
        self._codes, self._repeat = _parse_script(script)
        self._overrides = overrides
        self._pos = 0
        self._lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        self.injected: Counter[str] = Counter()

    @property
    def url(self) -> str:
        """The inner store's URL."""
        return self.inner.url

    def _next_code(self, method: str) -> str:
        """Count a call to `method` and consume its script code."""
        with self._lock:
            self.calls[method] += 1
            if self._pos < len(self._codes):
                code = self._codes[self._pos]
                self._pos += 1
            else:
                code = self._codes[-1] if self._repeat else "g"
            self.injected[code] += 1
            return code

    def _call(self, method: str, key: str, *args: Any) -> Any:
        """Run one store call under the next script code."""
        code = self._next_code(method)
        what = f"injected fault {code!r} in {method}({key!r})"
        if code == "E":
            raise StoreUnavailable(what, temporary=True)
        if code == "P":
            raise StoreUnavailable(what, temporary=False)
        if code == "M":
            raise ObjectMissing(key, self.url)
        if code == "S":
            time.sleep(self.delay)
        result = self._overrides.get(method, getattr(self.inner, method))(*args)
        if code == "C" and method in ("get", "get_range"):
            result = corrupt(result)
        return result

    def get(self, key: str, limit: int | None = None) -> bytes:
        """See `Store.get`."""
        return self._call("get", key, key, limit)  # type: ignore[no-any-return]

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """See `Store.get_range`."""
        return self._call("get_range", key, key, offset, length)  # type: ignore[no-any-return]

    def put(self, key: str, data: bytes) -> None:
        """See `Store.put`."""
        self._call("put", key, key, data)

    def put_file(self, key: str, path: Path | str) -> None:
        """See `Store.put_file`."""
        self._call("put_file", key, key, path)

    def exists(self, key: str) -> bool:
        """See `Store.exists`."""
        return bool(self._call("exists", key, key))

    def size(self, key: str) -> int:
        """See `Store.size`."""
        return int(self._call("size", key, key))

    def list(self, prefix: str = "") -> Iterator[str]:
        """See `Store.list`. The code is consumed when `list` is called, not per key; use a
        `list=` override to fail midway through a listing."""
        return iter(self._call("list", prefix, prefix))

    def delete(self, key: str) -> None:
        """See `Store.delete`."""
        self._call("delete", key, key)

    def check(self, write: bool = False) -> None:
        """See `Store.check`."""
        self._call("check", "", write)

    def close(self) -> None:
        """Close the inner store (not scripted)."""
        self.inner.close()

