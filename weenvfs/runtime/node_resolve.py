"""Resolving an environment in a remote store through the node service, not in this process.

Resolving a reference in an S3 store costs the calling process boto3: about 0.35 s of imports
and client set-up on this machine, more than the rest of a warm `weenv run` (issue 13). The
node service (`weenv mountd`, fuse/mountd.py) has boto3 loaded already, so a process that has
not imported it asks the service to fork `weenv sandbox resolve REF --json` instead, its
output on a pipe, and reads the `EnvSource` back. A failure to get an answer (no service, a
declined request, an answer that is not one) returns None: the caller then resolves
in-process. An error of the resolution itself (a missing reference, a store that refuses or
does not answer) comes back as `{"error", "exit_code"}` and is raised here with the same
message and exit code: resolving again in-process would only repeat it, and on a store that
stalls, wait as long again. A process that has boto3 already (a harness that opened
environments before) resolves in-process: that is cheaper than a fork.

The request goes out first and the answer is read later (`ask_node_service`, then
`PendingResolution.result`), so the caller can load what it needs next meanwhile
(environment.py: the sandbox's modules). A running service is asked through node_socket.py
alone; mountd.py (~12 ms to import) only when none answers and one must be started.

Must not: interpret what a resolution means (environment.py `resolve_source`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import sys
import time
from pathlib import Path
from typing import Any

from weenvfs.errors import WeenvError
from weenvfs.fuse import node_socket

from .env_source import EnvSource
from .recording import HINT_TAG

log = logging.getLogger(__name__)

# A remote store a fork of the node service resolves faster than this process would.
REMOTE_SCHEMES = ("s3://",)
# The resolution's own store round trips take milliseconds; past this, resolve in-process.
ANSWER_TIMEOUT = 30.0
MAX_ANSWER = 1 << 20


def worth_asking(store: str) -> bool:
    """Whether `store` is remote and this process has not paid for its client yet."""
    return (store.startswith(REMOTE_SCHEMES) and "boto3" not in sys.modules
            and node_socket.enabled())


class PendingResolution:
    """A resolution a fork of the node service is making; `result` waits for it (once)."""

    def __init__(self, ref: str, out_read: int, ready_read: int) -> None:
        self.ref = ref
        self._fds = [out_read, ready_read]

    def result(self) -> EnvSource | None:
        """The resolution, or None (see the module); raises the resolution's own error."""
        if not self._fds:
            raise RuntimeError("the resolution was taken already")
        try:
            return _source(_read_all(self._fds[0]))
        except (OSError, ValueError, KeyError, TypeError) as error:
            log.debug("the node service did not resolve %s: %s", self.ref, error)
            return None
        finally:
            self.close()

    def close(self) -> None:
        """Let the answer go unread (idempotent): the service's child then writes to a
        closed pipe and ends."""
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)

    def __del__(self) -> None:
        # A caller that never takes the result (`Environment.open` whose import of the
        # sandbox's modules raised) must not leave the two pipe ends open in its process.
        self.close()


def ask_node_service(ref: str, store: str, cache_dir: Path, record_hint: bool | None,
                     record_tag: str = HINT_TAG) -> PendingResolution | None:
    """Ask the node service to fork `weenv sandbox resolve REF --json`: its answer to
    come, or None when it took no request (see the module)."""
    argv = ["sandbox", "resolve", ref, "--store", store, "--cache", str(cache_dir), "--json"]
    if record_hint is not None:
        argv.append("--record-hint" if record_hint else "--no-record-hint")
    argv += ["--record-tag", record_tag]
    out_read, out_write = os.pipe()
    ready_read, ready_write = os.pipe()
    try:
        launched = _launch(argv, ready_write, out_write)
    except OSError as error:
        log.debug("the node service did not take the resolution of %s: %s", ref, error)
        launched = False
    finally:
        os.close(out_write)
        os.close(ready_write)
    if not launched:
        os.close(out_read)
        os.close(ready_read)
        return None
    return PendingResolution(ref, out_read, ready_read)


def _launch(argv: list[str], ready_fd: int, out_fd: int) -> bool:
    """The request through node_socket.py when a service answers, else mountd.py's `launch`,
    which starts one where this process may."""
    answer = node_socket.ask(node_socket.request_line(argv, node_socket.DAEMON),
                             [ready_fd, out_fd])
    if answer is None:
        from weenvfs.fuse import mountd

        return mountd.launch(argv, ready_fd, out_fd)
    if answer != b"ok":
        log.debug("the node service declined the resolution: %s",
                  answer.decode(errors="replace"))
    return answer == b"ok"


def _read_all(fd: int) -> bytes:
    """Everything written to the pipe `fd` until its writer exits (ValueError: too slow or
    too much)."""
    deadline = time.monotonic() + ANSWER_TIMEOUT
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise ValueError("no answer in time")
        part = os.read(fd, 65536)
        if not part:
            return data
        data += part
        if len(data) > MAX_ANSWER:
            raise ValueError("answer too long")


def _source(output: bytes) -> EnvSource | None:
    """The EnvSource printed by `weenv sandbox resolve --json` (None: it printed an error)."""
    # The JSON document is the last thing printed; a library may have logged before it.
    start = output.find(b"\n{") + 1 if not output.startswith(b"{") else 0
    with contextlib.suppress(ValueError, KeyError, TypeError):
        document: dict[str, Any] = json.loads(output[start:])
        if isinstance(document, dict) and "digest" in document:
            return source_from_json(document)
        if isinstance(document, dict) and isinstance(document.get("error"), str):
            raise resolution_error(document)
    log.debug("the node service's resolution failed: %s", output[-500:].decode(errors="replace"))
    return None


def error_to_json(error: Exception) -> dict[str, Any]:
    """A failed resolution as `weenv sandbox resolve --json` prints it."""
    return {"error": str(error), "exit_code": int(getattr(error, "exit_code", 1))}


def resolution_error(document: dict[str, Any]) -> WeenvError:
    """The error `error_to_json` printed, with its message and exit code."""
    error = WeenvError(str(document["error"]))
    code = document.get("exit_code")
    if isinstance(code, int) and 0 < code < 126:
        error.exit_code = code
    return error


def source_to_json(source: EnvSource) -> dict[str, Any]:
    """`source` as `weenv sandbox resolve --json` prints it."""
    return {"ref": source.ref, "digest": source.digest, "store_url": source.store_url,
            "cache_dir": str(source.cache_dir), "env": list(source.env), "cwd": source.cwd,
            "user": source.user, "command": list(source.command), "groups": list(source.groups),
            "record_tag": source.record_tag, "publish_later": source.publish_later,
            "entrypoint": list(source.entrypoint)}


def source_from_json(document: dict[str, Any]) -> EnvSource:
    """The EnvSource `source_to_json` printed (KeyError/TypeError/ValueError if it is not)."""
    def strings(key: str) -> tuple[str, ...]:
        value = document[key]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise TypeError(f"{key}: not a list of strings")
        return tuple(value)

    text = {key: str(document[key]) for key in ("ref", "digest", "store_url", "cwd", "user")}
    return EnvSource(text["ref"], text["digest"], text["store_url"],
                     Path(str(document["cache_dir"])), strings("env"), text["cwd"],
                     text["user"], strings("command"), strings("groups"),
                     _tag_or_none(document["record_tag"]),
                     document.get("publish_later") is True, strings("entrypoint"))


def _tag_or_none(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError("record_tag: not a string or null")
    return value
