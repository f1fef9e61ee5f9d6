"""The gRPC adapter: containerd's snapshots service v1 over `Snapshots` (snapshots.py).

A protocol adapter only: messages in, `Snapshots` calls, messages out; `SnapshotError`s
become the status their `code` names, with their message (containerd shows it to the user),
and any other exception becomes INTERNAL with one line, logged with its traceback here.
Every call's method, status and duration go to an `observe` callback (the metrics).

Owns: the method handlers (`handler()`), message conversion. Must not: decide anything a
snapshot does.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from . import api
from .snapshots import Mount, SnapshotError, Snapshots
from .state import Record

log = logging.getLogger(__name__)

LIST_BATCH = 100  # infos per ListSnapshotsResponse (containerd's own server sends 100)


def _mounts(mounts: list[Mount]) -> list[Any]:
    return [api.mount(kind, source, options) for kind, source, options in mounts]


def _info(record: Record) -> Any:
    info = api.message("Info")(name=record.key, parent=record.parent, kind=record.kind,
                               labels=record.labels)
    info.created_at.FromNanoseconds(int(record.created * 1e9))
    info.updated_at.FromNanoseconds(int(record.updated * 1e9))
    return info


def _record(info: Any) -> Record:
    return Record(0, info.name, info.parent, info.kind, dict(info.labels))


Observe = Callable[[str, str, float], None]  # (method, status code name, seconds) per call


def _ignore(method: str, code: str, seconds: float) -> None:
    pass


def _guarded(method: str, fn: Callable[..., Any], observe: Observe
             ) -> Callable[[Any, grpc.ServicerContext], Any]:
    @functools.wraps(fn)
    def call(request: Any, context: grpc.ServicerContext) -> Any:
        started, code = time.monotonic(), "INTERNAL"
        try:
            answer = fn(request)
            code = "OK"
            return answer
        except SnapshotError as error:
            log.info("%s: %s", method, error)
            code = error.code
            context.abort(getattr(grpc.StatusCode, error.code), str(error))
        except Exception as error:  # noqa: BLE001 - the one place that answers INTERNAL
            log.exception("%s failed", method)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}")
        finally:
            observe(method, code, time.monotonic() - started)
    return call


def _guarded_stream(method: str, fn: Callable[[Any], Iterator[Any]], observe: Observe
                    ) -> Callable[[Any, grpc.ServicerContext], Iterator[Any]]:
    def call(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        started, code = time.monotonic(), "INTERNAL"
        try:
            yield from fn(request)
            code = "OK"
        except SnapshotError as error:
            code = error.code
            context.abort(getattr(grpc.StatusCode, error.code), str(error))
        except Exception as error:  # noqa: BLE001
            log.exception("%s failed", method)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}")
        finally:
            observe(method, code, time.monotonic() - started)
    return call


def handler(snaps: Snapshots, observe: Observe = _ignore) -> grpc.GenericRpcHandler:
    """The service's handlers, for `grpc.Server.add_generic_rpc_handlers`; `observe` is told
    of every call (metrics.py)."""
    empty = api.message("google.protobuf.Empty")

    def prepare(r: Any) -> Any:
        return api.message("PrepareSnapshotResponse")(
            mounts=_mounts(snaps.prepare(r.key, r.parent, dict(r.labels))))

    def view(r: Any) -> Any:
        return api.message("ViewSnapshotResponse")(
            mounts=_mounts(snaps.view(r.key, r.parent, dict(r.labels))))

    def mounts(r: Any) -> Any:
        return api.message("MountsResponse")(mounts=_mounts(snaps.mounts(r.key)))

    def commit(r: Any) -> Any:
        snaps.commit(r.name, r.key, dict(r.labels))
        return empty()

    def remove(r: Any) -> Any:
        snaps.remove(r.key)
        return empty()

    def stat(r: Any) -> Any:
        return api.message("StatSnapshotResponse")(info=_info(snaps.stat(r.key)))

    def update(r: Any) -> Any:
        record = snaps.update(_record(r.info), list(r.update_mask.paths))
        return api.message("UpdateSnapshotResponse")(info=_info(record))

    def usage(r: Any) -> Any:
        size, inodes = snaps.usage(r.key)
        return api.message("UsageResponse")(size=size, inodes=inodes)

    def cleanup(r: Any) -> Any:
        snaps.cleanup()
        return empty()

    def list_(r: Any) -> Iterator[Any]:
        batch = []
        for record in snaps.walk(list(r.filters)):
            batch.append(_info(record))
            if len(batch) == LIST_BATCH:
                yield api.message("ListSnapshotsResponse")(info=batch)
                batch = []
        if batch:
            yield api.message("ListSnapshotsResponse")(info=batch)

    unary = {"Prepare": prepare, "View": view, "Mounts": mounts, "Commit": commit,
             "Remove": remove, "Stat": stat, "Update": update, "Usage": usage,
             "Cleanup": cleanup}
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for name, (request, response, streaming) in api.METHODS.items():
        decode = api.message(request).FromString
        encode = api.message(response).SerializeToString
        if streaming:
            handlers[name] = grpc.unary_stream_rpc_method_handler(
                _guarded_stream(name, list_, observe), request_deserializer=decode,
                response_serializer=encode)
        else:
            handlers[name] = grpc.unary_unary_rpc_method_handler(
                _guarded(name, unary[name], observe), request_deserializer=decode,
                response_serializer=encode)
    return grpc.method_handlers_generic_handler(api.SERVICE, handlers)
