"""The kernel path's data devices served natively: `weenv-devserve` (native/) and its channel.

The third protocol adapter, next to device_ops.py (the same folder of devices served by
pyfuse3, the fallback) and ops.py (the FUSE tree). Every EROFS page-cache miss is one read of
a device file, on the reader's critical path; through pyfuse3 and the reader one costs
~150-250 us of Python. Here the daemon mounts the device folder on a /dev/fuse descriptor of
its own and starts `weenv-devserve`, which answers from C every request it can: lookups,
attributes, opens, and reads whose chunks this process has handed it as verified chunk
files, and reads of chunks it fetches itself from frame sources this process hands it (a
local folder store's blob files, opened once at mount; the neighbourhoods the fetcher
brings from any other store, in memfds that expire): it verifies and caches them as the
fetcher would and reports each ('W': stats, the cache's bound, the stash). The rest
comes back over a socket (records, see the C file's header): a read of a
chunk not handed over yet (served here by the `DeviceReader` exactly as device_ops.py does,
answered on the FUSE descriptor, then its chunk files are handed over; a chunk the node cache
trusts, verified in this boot by any process, the server opens itself), the stats xattr,
"every device released". A statfs of the folder, how the runtime asks whether the daemon
lives (daemon.check_answers), the server answers itself: it serves only while this
process's end of the channel is open. What the native server served without asking is reported as
records of file ranges that start a file or reach a new chunk of it, so the reader's
read-ahead and hint recording (core/reader.py `note_served`) see what they would have seen,
and its counters (reads, bytes, cache hits) are folded into the mount's `Stats`.

Faults: the native server ends with the daemon (the channel closes; the FUSE connection goes
with the last descriptor, so readers get errors, never a hang), and if it ends first, this
process closes its own descriptor, which aborts the connection the same way, and the mount
fails with an error. A read that fails is answered as the fetcher fails it (EIO at the
deadline); the kernel's own retries of it, from the same task at once, continue that wait
instead of starting a new one (`FailedReads`: the records carry the asking task's id).

Must not: know EROFS bytes or fetch by itself (core/), or decide the mount's lifecycle
(kernel_mount.py).
"""

from __future__ import annotations

import array
import contextlib
import errno
import json
import logging
import mmap
import os
import socket
import struct
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import trio

from weenvfs import native_programs
from weenvfs.core.device_reader import DeviceReader
from weenvfs.core.tree import FormatError, make_inode

from . import syscalls
from .errno_map import OnceLog, to_errno
from .failed_reads import FailedReads, Retry, reads_done
from .mount_copies import remove_mount_folder

log = logging.getLogger(__name__)

HELPER = "weenv-devserve"
# WEENV_DEVICE_SERVER=python serves the devices with pyfuse3 (device_ops.py) instead.
SERVER_VARIABLE = "WEENV_DEVICE_SERVER"

# type, flags, device, size, unique, offset, inode, and for 'R' the asking task (0: unknown)
_RECORD = struct.Struct("<BBHIQQII")
_CHUNK = struct.Struct("<BBHI")  # 'C', 0, device, chunk number (+ one SCM_RIGHTS descriptor)
# 'F', flags (bit 0: it expires), device, blob number, start, length (+ one descriptor): a
# frame source, its bytes from 0 being the blob's [start, start + length)
_SOURCE = struct.Struct("<BBHIQQ")
_MAP_HEAD = struct.Struct("<8sII")
_MAP_DEVICE = struct.Struct("<16sQIIIIQQQ")
_OUT_HEADER = struct.Struct("<iiQ")  # fuse_out_header: len, -errno, unique
_XATTR_SIZE = struct.Struct("<II")  # fuse_getxattr_out
# reads, bytes, hits, zero chunks, forwarded, open, held, chunks fetched, fetches natively
_COUNTERS = struct.Struct("<9Q")
_MAX_HANDOVER = 64  # chunk descriptors in one message (the C side's receive buffer)
_STOP_WAIT = 5.0  # seconds the native server gets to end after its folder is unmounted
assert _RECORD.size == 32 and _MAP_DEVICE.size == 64 and _SOURCE.size == 24


def choose_server() -> tuple[str | None, str | None]:
    """(the native server's executable, None) where it serves the devices: next to this
    Python's, as scripts/setup.sh installs it, else in the package, as a wheel carries it
    (setup.py), else on PATH; else (None, why pyfuse3 does): `WEENV_DEVICE_SERVER=python`,
    or not installed."""
    if os.environ.get(SERVER_VARIABLE, "native") == "python":
        return None, f"{SERVER_VARIABLE}=python"
    found = native_programs.find(HELPER)
    if found is None:
        return None, (f"{HELPER} is not installed (scripts/setup.sh builds it; a wheel built "
                      "without a C compiler lacks it)")
    return found, None


def device_map(devices: Mapping[bytes, DeviceReader]) -> list[bytes | memoryview]:
    """The map the native server reads (the C file's header), in parts to write one after
    the other: per device its name, size, saved layout and the index tables it needs to turn
    file ranges into chunk ranges (views of the index, not copies: 7 MB at 100k files)."""
    heads: list[bytes | memoryview] = []
    bodies: list[bytes | memoryview] = []
    at = _MAP_HEAD.size + _MAP_DEVICE.size * len(devices)
    for name in sorted(devices):
        device = devices[name]
        index = device.reader.tree.groups[device.group]
        h = index.header
        layout = device.layout.to_bytes()
        # The index's records as stored (SPEC.md 6.4, 6.6): the server reads them in place.
        inodes, chunks = index.inode_table(), index.chunk_table()
        heads.append(_MAP_DEVICE.pack(name, device.size, h.chunk_size, h.inode_count,
                                      h.chunk_count, h.blob_count, at, at + len(layout),
                                      at + len(layout) + len(inodes)))
        bodies += [layout, inodes, chunks]
        at += len(layout) + len(inodes) + len(chunks)
    return [_MAP_HEAD.pack(b"WEDVMAP1", len(devices), 0), *heads, *bodies]


def _memfd(name: str, parts: list[bytes | memoryview]) -> int:
    """A memfd holding `parts`, one after the other."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    for part in parts:
        view = memoryview(part)
        while view:
            view = view[os.write(fd, view):]
    return fd


def _mapped(fd: int, size: int) -> mmap.mmap | None:
    """A read-only shared mapping of the first `size` bytes of memfd `fd` (it stays valid
    once `fd` is closed), or None where the kernel refuses one (the caller keeps its copy)."""
    try:
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    except (OSError, ValueError) as error:
        log.debug("mapping a neighbourhood: %s", error)
        return None


def _send_now(channel: socket.socket, records: list[bytes], fds: list[int]) -> None:
    """Send `records`, each with its descriptor, in messages the server takes whole (at most
    `_MAX_HANDOVER` each), on the raw socket (not through trio)."""
    for at in range(0, len(fds), _MAX_HANDOVER):
        channel.sendmsg([b"".join(records[at:at + _MAX_HANDOVER])],
                        [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                          array.array("i", fds[at:at + _MAX_HANDOVER]))])


class NativeDevices:
    """The folder of `devices` (file name -> device), served by the native server."""

    def __init__(self, devices: Mapping[bytes, DeviceReader], helper: str,
                 document: Callable[[], dict[str, Any]] | None = None,
                 on_released: Callable[[], None] | None = None) -> None:
        self.helper = helper
        self.names = sorted(devices)
        self.devices = [devices[name] for name in self.names]
        # The mount's: every device reads through its one reader, fetcher and cache.
        fetcher = self.devices[0].reader.fetcher
        self.stats, self.cache = fetcher.stats, fetcher.cache
        self.document = document
        self.on_released = on_released
        self.error_log = OnceLog()
        self._fuse_fd = -1
        self._channel: socket.socket | None = None
        self._trio_channel: Any = None
        self._sending = trio.Lock()  # one sender at a time (trio: one writer per socket)
        self._counters: mmap.mmap | None = None
        self._folded = [0] * 4
        self._process: subprocess.Popen[bytes] | None = None
        self._folder: Path | None = None
        self._stopping = False
        self._cancel = trio.CancelScope()
        self._places: dict[str, list[tuple[int, int]]] | None = None  # blob -> (dev, number)
        self.failed_reads = FailedReads()
        self.failure: str | None = None  # why the server ended before it was told to

    # -- lifecycle ----------------------------------------------------------------------------

    def mount(self, folder: Path) -> None:
        """Mount the device folder at `folder` and start the native server on it."""
        fds: list[int] = []  # the server's: its channel, the map, the counters
        try:
            self._fuse_fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self._channel = ours
            fds.append(theirs.detach())
            fds.append(_memfd("weenv-device-map", device_map(dict(zip(self.names,
                                                                        self.devices,
                                                                        strict=True)))))
            fds.append(_memfd("weenv-device-counters", [bytes(mmap.PAGESIZE)]))
            self._counters = mmap.mmap(fds[-1], mmap.PAGESIZE, prot=mmap.PROT_READ)
            syscalls.mount("weenv-device", folder, "fuse.weenv",
                           f"fd={self._fuse_fd},rootmode=40000,user_id={os.getuid()},"
                           f"group_id={os.getgid()},default_permissions",
                           flags=syscalls.MS_RDONLY | syscalls.MS_NODEV | syscalls.MS_NOSUID)
            self._folder = folder
            root, marker = self.cache.trust_marker()
            trusted = [root, marker.decode()] if marker else []
            self._process = subprocess.Popen(
                [self.helper, str(self._fuse_fd), *(str(fd) for fd in fds), *trusted],
                pass_fds=[self._fuse_fd, *fds], stdin=subprocess.DEVNULL)
            self._send_sources(ours)
            self._trio_channel = trio.socket.from_stdlib_socket(ours)  # non-blocking from here
        except BaseException:
            self.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)
        log.info("data devices served by %s (pid %d)", self.helper, self._process.pid)
        if marker:
            self.devices[0].reader.fetcher.on_stashed = self._share_frames

    def terminate(self) -> None:
        """End `main` (the folder stays mounted until `close`)."""
        self._stopping = True
        self._cancel.cancel()

    @property
    def open_handles(self) -> int:
        """Device handles the kernel holds open."""
        return self._read_counters()[5]

    def close(self) -> None:
        """Unmount the folder (lazily when busy) and remove it, let the native server end,
        release everything (idempotent). The folder goes first: a copy of its mount in
        another mount namespace keeps the connection, so the server waits on (its end is
        the connection's), until the folder's removal detaches the copy (mount_copies.py)."""
        self._stopping = True
        if self._folder is not None:
            try:
                syscalls.umount(self._folder)
            except OSError:
                with contextlib.suppress(OSError):
                    syscalls.umount(self._folder, detach=True)
            remove_mount_folder(self._folder)
            self._folder = None
        if self._process is not None:
            try:
                self._process.wait(_STOP_WAIT)
            except subprocess.TimeoutExpired:
                log.warning("%s did not end: killing it", HELPER)
                self._process.kill()
                self._process.wait()
            self._process = None
        self.fold_counters()
        if self._channel is not None:
            # Not through trio (this may run in a thread): no task waits on it any more.
            self._channel.close()
            self._channel = self._trio_channel = None
        if self._fuse_fd >= 0:
            os.close(self._fuse_fd)
            self._fuse_fd = -1
        if self._counters is not None:
            self._counters.close()
            self._counters = None

    # -- counters -----------------------------------------------------------------------------

    def _read_counters(self) -> tuple[int, ...]:
        if self._counters is None:
            return (0,) * (_COUNTERS.size // 8)
        return _COUNTERS.unpack_from(self._counters)

    def summary(self) -> dict[str, int | bool | str | None]:
        """What `weenv stats` shows of the native server: reads it served itself, requests
        it forwarded here, chunk files it holds open, chunks it fetched from frame sources
        itself, whether it can, and why not."""
        reads, _, _, _, forwarded, _, held, fetched, built = self._read_counters()
        why = None
        if not built:
            why = (f"{HELPER} was built without zstd and BLAKE3 (native/decode-flags.sh found "
                   "no zstd.h or no BLAKE3 C sources: Debian's libzstd-dev, librust-blake3-dev)")
        elif not self.cache.trust_marker()[1]:
            why = ("the node cache cannot mark the chunks it verified (no user xattrs on its "
                   "file system), so the server caches none")
        return {"served_reads": reads, "forwarded": forwarded, "held_chunks": held,
                "fetched_chunks": fetched, "fetches": why is None, "fetches_reason": why}

    def fold_counters(self) -> None:
        """Add what the native server served since the last call to the mount's `Stats`."""
        now = self._read_counters()[:4]
        reads, served, hits, zeros = (a - b for a, b in zip(now, self._folded, strict=True))
        self._folded = list(now)
        self.stats.reads += reads
        self.stats.bytes_served += served
        self.stats.cache_hits += hits
        self.stats.zero_chunks += zeros

    # -- the channel --------------------------------------------------------------------------

    async def main(self) -> None:
        """Answer what the native server forwards until `terminate()`, or until the server
        ends first: then its connection is aborted (readers get errors) and `failure` says
        why (raised by the caller once the mount is torn down)."""
        channel = self._trio_channel
        with self._cancel:
            async with trio.open_nursery() as nursery:
                while True:
                    try:
                        message = await channel.recv(_RECORD.size * 256)
                    except OSError:  # ECONNRESET: the server died with records unsent
                        message = b""
                    if not message:
                        break
                    for record in _RECORD.iter_unpack(message):
                        self._dispatch(record, nursery)
                self._server_ended()

    def _server_ended(self) -> None:
        if self._stopping:
            return
        status = self._process.poll() if self._process is not None else None
        # Nobody reads the device folder's requests now: close ours, the connection aborts.
        os.close(self._fuse_fd)
        self._fuse_fd = -1
        self.failure = f"{HELPER} ended (status {status}): the mount's data devices are gone"
        log.error("%s", self.failure)

    def _dispatch(self, record: tuple[int, ...], nursery: trio.Nursery) -> None:
        kind, flags, dev, size, unique, offset, ino, pid = record
        if kind == ord("R") and dev < len(self.devices):
            # Here, not in the task: tasks start in no fixed order, a task's reads arrive in it.
            retry = self.failed_reads.retry_of(pid, dev, offset, size)
            nursery.start_soon(self._read, self.devices[dev], dev, unique, offset, size,
                               bool(flags & 1), pid, retry)
        elif kind == ord("T") and dev < len(self.devices):
            device = self.devices[dev]
            with contextlib.suppress(Exception):  # a hint for read-ahead only
                device.reader.note_served(make_inode(device.group, ino), offset, size,
                                          bool(flags & 1))
        elif kind == ord("U") and dev < len(self.devices):
            # A cached chunk the server opened itself (trusted): its first demand use.
            with contextlib.suppress(Exception):
                self.stats.record_demand_use(self.devices[dev].chunk(ino).digest)
        elif kind == ord("W") and dev < len(self.devices):
            # A chunk the server fetched from a frame source, verified and cached itself.
            device = self.devices[dev]
            with contextlib.suppress(Exception):
                device.reader.fetcher.note_fetched_elsewhere(device.chunk(ino), size,
                                                             offset / 1e9)
        elif kind == ord("X"):
            self._xattr(unique, size)
        elif kind == ord("E") and self.on_released is not None:
            self.on_released()

    def _reply(self, unique: int, error: int, data: bytes = b"") -> None:
        header = _OUT_HEADER.pack(_OUT_HEADER.size + (0 if error else len(data)), -error,
                                  unique)
        try:
            os.writev(self._fuse_fd, [header] if error else [header, data])
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ENODEV, errno.EBADF):
                log.warning("answering a device request: %s", e)

    async def _read(self, device: DeviceReader, dev: int, unique: int, offset: int, size: int,
                    follows: bool, pid: int = 0, retry: Retry | None = None) -> None:
        """Answer a forwarded read. `retry`: it may be the kernel's retry of a read that failed
        (`FailedReads`); if so, it is served from the cache when its data came meanwhile,
        else given what is left of the failed read's deadline (then that read's errno)."""
        started = trio.current_time()
        if retry is not None and retry.reads_done is not None:
            done = await reads_done(pid)
            if done is not None and done != retry.reads_done:
                retry = None  # the task's read(2) ended since: this is a read of its own
        data: bytes | None = None
        try:
            if follows:
                device.continued(offset)
            data = device.read_cached(offset, size)
            if data is None and retry is None:
                data = await device.read(offset, size)
            elif data is None and retry is not None and retry.ends > trio.current_time():
                with trio.move_on_at(retry.ends):
                    data = await device.read(offset, size)
        except Exception as error:  # noqa: BLE001 - every failure is an errno for the kernel
            code = to_errno(error, self.error_log, "read")
            # Before the answer, which the kernel's retry follows; a retry continues its wait.
            ends = retry.ends if retry else started + device.reader.fetcher.deadline
            self.failed_reads.failed(pid, dev, offset, size,
                                     Retry(code, ends, await reads_done(pid)))
            self._reply(unique, code)
            return
        if data is None:  # a retry whose deadline ran out: the answer its read got
            assert retry is not None
            self.failed_reads.failed(pid, dev, offset, size, retry)
            self._reply(unique, retry.error)
            return
        self._reply(unique, 0, data)
        await self._hand_over(device, dev, offset, size)

    async def _hand_over(self, device: DeviceReader, dev: int, offset: int, size: int) -> None:
        """Give the native server the verified chunk files of what was just read."""
        records: list[bytes] = []
        fds: list[int] = []
        fetcher = device.reader.fetcher
        try:
            for number, loc in device.chunks(offset, size):
                fd = fetcher.verified_file(loc)
                if fd is not None:
                    records.append(_CHUNK.pack(ord("C"), 0, dev, number))
                    fds.append(fd)
            for at in range(0, len(fds), _MAX_HANDOVER):
                await self._send(records[at:at + _MAX_HANDOVER], fds[at:at + _MAX_HANDOVER])
        except (OSError, FormatError, trio.ClosedResourceError,
                trio.BrokenResourceError) as error:
            log.debug("handing chunk files over: %s", error)
        finally:
            for fd in fds:
                os.close(fd)

    def _send_sources(self, channel: socket.socket) -> None:
        """Hand the server the blob files of a store it can read itself (a local folder:
        `Store.local_file`), as frame sources: it then fetches chunks from them without a
        round trip here (the C file's header). Each file is opened once, whichever devices
        share it; one missing here is left to the fetcher (which reports it). Sent before
        the devices are used (the server takes every waiting message before a request)."""
        if not self.cache.trust_marker()[1]:
            return  # the server trusts no cache file, so it caches none either
        store = self.devices[0].reader.fetcher.store
        records: list[bytes] = []
        fds: list[int] = []
        opened: list[int] = []
        try:
            for blob, places in self._blob_places().items():
                path = store.local_file(f"blobs/{blob}")
                if path is None:
                    return  # not a folder of files: the fetcher fetches everything
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
                except OSError:
                    continue
                opened.append(fd)
                size = os.fstat(fd).st_size
                for dev, number in places:
                    records.append(_SOURCE.pack(ord("F"), 0, dev, number, 0, size))
                    fds.append(fd)
            channel.settimeout(_STOP_WAIT)  # the server takes them at once; never stuck here
            _send_now(channel, records, fds)
        except OSError as error:  # the server ended: main() reports it
            log.debug("handing frame sources over: %s", error)
        finally:
            for fd in opened:
                os.close(fd)

    def _blob_places(self) -> dict[str, list[tuple[int, int]]]:
        """Where each blob is in the devices' indexes: (device, blob number) pairs."""
        if self._places is None:
            self._places = {}
            for dev, device in enumerate(self.devices):
                index = device.reader.tree.groups[device.group]
                for number, blob in enumerate(index.blob_digests()):
                    self._places.setdefault(blob, []).append((dev, number))
        return self._places

    def _share_frames(self, blob: str, start: int, data: bytes) -> mmap.mmap | None:
        """Hand the server a neighbourhood the fetcher just brought (blob bytes from `start`)
        as an expiring frame source, so that it serves the misses it holds without a round
        trip here (the C file's header); returns a read-only mapping of the memfd it sent,
        for the fetcher to keep instead of `data` (one copy of the bytes in memory, not two:
        ~75 MB less for the reference image's first run), or None. Best effort: a full
        channel drops it (the daemon serves those misses from its own copy, as before)."""
        places = self._blob_places().get(blob)
        if not places or self._channel is None or not self._read_counters()[8]:
            return None
        fd = _memfd("weenv-frames", [data])
        try:
            _send_now(self._channel,
                      [_SOURCE.pack(ord("F"), 1, dev, number, start, len(data))
                       for dev, number in places], [fd] * len(places))
            return _mapped(fd, len(data))
        except OSError as error:  # BlockingIOError: the server is behind; it goes without
            log.debug("handing a neighbourhood over: %s", error)
            return None
        finally:
            os.close(fd)

    async def _send(self, records: list[bytes], fds: list[int]) -> None:
        if self._channel is None:
            return
        async with self._sending:
            await self._trio_channel.sendmsg(
                [b"".join(records)],
                [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])

    def _xattr(self, unique: int, size: int) -> None:
        if self.document is None:
            self._reply(unique, errno.ENODATA)
            return
        self.fold_counters()
        document = self.document()
        document.setdefault("mount", {})["native_server"] = self.summary()
        value = json.dumps(document, sort_keys=True).encode()
        if size == 0:
            self._reply(unique, 0, _XATTR_SIZE.pack(len(value), 0))
        elif size < len(value):
            self._reply(unique, errno.ERANGE)
        else:
            self._reply(unique, 0, value)
