"""containerd's snapshots API v1 (and the parts of its leases, content and images APIs v1 that
`weenv pull` uses) as protobuf messages, built at import from these tables.

The tables mirror `api/services/snapshots/v1/snapshots.proto`, `api/types/mount.proto`,
`api/types/descriptor.proto` and the `leases`, `content` and `images` services' .proto files
of containerd 1.6 (field names, numbers and types; the gogoproto options change only Go
code).
Why not generated code or protoc at install time: the .proto files import gogoproto, which no
Python package ships, and production nodes have no Go sources to compile from; the wire
format is fixed by names and numbers, which this table states and
tests/snapshotter/test_api.py checks against the .proto files Debian's
golang-github-containerd-containerd-dev installs (docs/design-notes.md).

Owns: the message classes (`message(name)`), the services' full names and method tables. Must
not: implement any method (service.py).
"""

from __future__ import annotations

from typing import Any

from google.protobuf import (
    descriptor_pb2,
    descriptor_pool,
    empty_pb2,
    field_mask_pb2,
    timestamp_pb2,
)
from google.protobuf.message_factory import GetMessageClass

SERVICE = "containerd.services.snapshots.v1.Snapshots"
PACKAGE = "containerd.services.snapshots.v1"
TYPES_PACKAGE = "containerd.types"
LEASES_SERVICE = "containerd.services.leases.v1.Leases"
LEASES_PACKAGE = "containerd.services.leases.v1"
CONTENT_SERVICE = "containerd.services.content.v1.Content"
CONTENT_PACKAGE = "containerd.services.content.v1"
IMAGES_SERVICE = "containerd.services.images.v1.Images"
IMAGES_PACKAGE = "containerd.services.images.v1"

STRING, INT64, BOOL, BYTES, ENUM, MESSAGE = "string", "int64", "bool", "bytes", "enum", "message"
# message -> fields (name, number, type, repeated, message/enum type name)
Field = tuple[str, int, str, bool, str]
MOUNT: dict[str, list[Field]] = {
    "Mount": [("type", 1, STRING, False, ""), ("source", 2, STRING, False, ""),
              ("target", 3, STRING, False, ""), ("options", 4, STRING, True, "")],
}
DESCRIPTOR: dict[str, list[Field]] = {
    "Descriptor": [("media_type", 1, STRING, False, ""), ("digest", 2, STRING, False, ""),
                   ("size", 3, INT64, False, ""),
                   ("annotations", 5, MESSAGE, True, "AnnotationsEntry")],
}
_LABELS = ("labels", 4, MESSAGE, True, "LabelsEntry")  # map<string, string>
_MOUNTS = ("mounts", 1, MESSAGE, True, ".containerd.types.Mount")
MESSAGES: dict[str, list[Field]] = {
    "PrepareSnapshotRequest": [("snapshotter", 1, STRING, False, ""),
                               ("key", 2, STRING, False, ""),
                               ("parent", 3, STRING, False, ""), _LABELS],
    "PrepareSnapshotResponse": [_MOUNTS],
    "ViewSnapshotRequest": [("snapshotter", 1, STRING, False, ""),
                            ("key", 2, STRING, False, ""),
                            ("parent", 3, STRING, False, ""), _LABELS],
    "ViewSnapshotResponse": [_MOUNTS],
    "MountsRequest": [("snapshotter", 1, STRING, False, ""), ("key", 2, STRING, False, "")],
    "MountsResponse": [_MOUNTS],
    "RemoveSnapshotRequest": [("snapshotter", 1, STRING, False, ""),
                              ("key", 2, STRING, False, "")],
    "CommitSnapshotRequest": [("snapshotter", 1, STRING, False, ""),
                              ("name", 2, STRING, False, ""),
                              ("key", 3, STRING, False, ""), _LABELS],
    "StatSnapshotRequest": [("snapshotter", 1, STRING, False, ""),
                            ("key", 2, STRING, False, "")],
    "Info": [("name", 1, STRING, False, ""), ("parent", 2, STRING, False, ""),
             ("kind", 3, ENUM, False, "Kind"),
             ("created_at", 4, MESSAGE, False, ".google.protobuf.Timestamp"),
             ("updated_at", 5, MESSAGE, False, ".google.protobuf.Timestamp"),
             ("labels", 6, MESSAGE, True, "LabelsEntry")],
    "StatSnapshotResponse": [("info", 1, MESSAGE, False, "Info")],
    "UpdateSnapshotRequest": [("snapshotter", 1, STRING, False, ""),
                              ("info", 2, MESSAGE, False, "Info"),
                              ("update_mask", 3, MESSAGE, False, ".google.protobuf.FieldMask")],
    "UpdateSnapshotResponse": [("info", 1, MESSAGE, False, "Info")],
    "ListSnapshotsRequest": [("snapshotter", 1, STRING, False, ""),
                             ("filters", 2, STRING, True, "")],
    "ListSnapshotsResponse": [("info", 1, MESSAGE, True, "Info")],
    "UsageRequest": [("snapshotter", 1, STRING, False, ""), ("key", 2, STRING, False, "")],
    "UsageResponse": [("size", 1, INT64, False, ""), ("inodes", 2, INT64, False, "")],
    "CleanupRequest": [("snapshotter", 1, STRING, False, "")],
}
KINDS = {"UNKNOWN": 0, "VIEW": 1, "ACTIVE": 2, "COMMITTED": 3}
# method -> (request, response, server streaming)
METHODS: dict[str, tuple[str, str, bool]] = {
    "Prepare": ("PrepareSnapshotRequest", "PrepareSnapshotResponse", False),
    "View": ("ViewSnapshotRequest", "ViewSnapshotResponse", False),
    "Mounts": ("MountsRequest", "MountsResponse", False),
    "Commit": ("CommitSnapshotRequest", "google.protobuf.Empty", False),
    "Remove": ("RemoveSnapshotRequest", "google.protobuf.Empty", False),
    "Stat": ("StatSnapshotRequest", "StatSnapshotResponse", False),
    "Update": ("UpdateSnapshotRequest", "UpdateSnapshotResponse", False),
    "List": ("ListSnapshotsRequest", "ListSnapshotsResponse", True),
    "Usage": ("UsageRequest", "UsageResponse", False),
    "Cleanup": ("CleanupRequest", "google.protobuf.Empty", False),
}
# The leases messages `weenv pull` sends and receives (containerd 1.6, leases.proto).
LEASE_MESSAGES: dict[str, list[Field]] = {
    "Lease": [("id", 1, STRING, False, ""),
              ("created_at", 2, MESSAGE, False, ".google.protobuf.Timestamp"),
              ("labels", 3, MESSAGE, True, "LabelsEntry")],
    "CreateRequest": [("id", 1, STRING, False, ""), ("labels", 3, MESSAGE, True, "LabelsEntry")],
    "CreateResponse": [("lease", 1, MESSAGE, False, "Lease")],
    "DeleteRequest": [("id", 1, STRING, False, ""), ("sync", 2, BOOL, False, "")],
}
LEASE_METHODS: dict[str, tuple[str, str, bool]] = {
    "Create": ("CreateRequest", "CreateResponse", False),
    "Delete": ("DeleteRequest", "google.protobuf.Empty", False),
}
# The content messages `weenv pull` sends and receives (content.proto): it writes an image's
# manifest and config into containerd's content store, with their labels.
_TIMESTAMP = ".google.protobuf.Timestamp"
CONTENT_MESSAGES: dict[str, list[Field]] = {
    "Info": [("digest", 1, STRING, False, ""), ("size", 2, INT64, False, ""),
             ("created_at", 3, MESSAGE, False, _TIMESTAMP),
             ("updated_at", 4, MESSAGE, False, _TIMESTAMP),
             ("labels", 5, MESSAGE, True, "LabelsEntry")],
    "InfoRequest": [("digest", 1, STRING, False, "")],
    "InfoResponse": [("info", 1, MESSAGE, False, "Info")],
    "UpdateRequest": [("info", 1, MESSAGE, False, "Info"),
                      ("update_mask", 2, MESSAGE, False, ".google.protobuf.FieldMask")],
    "UpdateResponse": [("info", 1, MESSAGE, False, "Info")],
    "WriteContentRequest": [("action", 1, ENUM, False, "WriteAction"),
                            ("ref", 2, STRING, False, ""), ("total", 3, INT64, False, ""),
                            ("expected", 4, STRING, False, ""), ("offset", 5, INT64, False, ""),
                            ("data", 6, BYTES, False, ""),
                            ("labels", 7, MESSAGE, True, "LabelsEntry")],
    "WriteContentResponse": [("action", 1, ENUM, False, "WriteAction"),
                             ("started_at", 2, MESSAGE, False, _TIMESTAMP),
                             ("updated_at", 3, MESSAGE, False, _TIMESTAMP),
                             ("offset", 4, INT64, False, ""), ("total", 5, INT64, False, ""),
                             ("digest", 6, STRING, False, "")],
}
WRITE_ACTIONS = {"STAT": 0, "WRITE": 1, "COMMIT": 2}
# method -> (request, response, response streamed); Write streams its requests too.
CONTENT_METHODS: dict[str, tuple[str, str, bool]] = {
    "Info": ("InfoRequest", "InfoResponse", False),
    "Update": ("UpdateRequest", "UpdateResponse", False),
    "Write": ("WriteContentRequest", "WriteContentResponse", True),
}
# The images messages `weenv pull` uses (images.proto): the image record.
IMAGES_MESSAGES: dict[str, list[Field]] = {
    "Image": [("name", 1, STRING, False, ""), ("labels", 2, MESSAGE, True, "LabelsEntry"),
              ("target", 3, MESSAGE, False, ".containerd.types.Descriptor"),
              ("created_at", 7, MESSAGE, False, _TIMESTAMP),
              ("updated_at", 8, MESSAGE, False, _TIMESTAMP)],
    "CreateImageRequest": [("image", 1, MESSAGE, False, "Image")],
    "CreateImageResponse": [("image", 1, MESSAGE, False, "Image")],
    "UpdateImageRequest": [("image", 1, MESSAGE, False, "Image"),
                           ("update_mask", 2, MESSAGE, False, ".google.protobuf.FieldMask")],
    "UpdateImageResponse": [("image", 1, MESSAGE, False, "Image")],
}
IMAGES_METHODS: dict[str, tuple[str, str, bool]] = {
    "Create": ("CreateImageRequest", "CreateImageResponse", False),
    "Update": ("UpdateImageRequest", "UpdateImageResponse", False),
}
_TYPES = {STRING: descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
          INT64: descriptor_pb2.FieldDescriptorProto.TYPE_INT64,
          BOOL: descriptor_pb2.FieldDescriptorProto.TYPE_BOOL,
          BYTES: descriptor_pb2.FieldDescriptorProto.TYPE_BYTES,
          ENUM: descriptor_pb2.FieldDescriptorProto.TYPE_ENUM,
          MESSAGE: descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE}


def _add_message(file: descriptor_pb2.FileDescriptorProto, name: str,
                 fields: list[Field]) -> None:
    package = file.package
    msg = file.message_type.add(name=name)
    for fname, number, kind, repeated, type_name in fields:
        field = msg.field.add(name=fname, number=number, type=_TYPES[kind], json_name=fname)
        field.label = (descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED if repeated
                       else descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
        if type_name in ("LabelsEntry", "AnnotationsEntry"):  # map<string, string>
            field.type_name = f".{package}.{name}.{type_name}"
            entry = msg.nested_type.add(name=type_name)
            entry.options.map_entry = True
            for key, num in (("key", 1), ("value", 2)):
                entry.field.add(name=key, number=num, type=_TYPES[STRING], json_name=key,
                                label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
        elif type_name:
            field.type_name = type_name if type_name.startswith(".") else (
                f".{package}.{type_name}")


_PROTO = "github.com/containerd/containerd/api/"
_EMPTY, _MASK, _TIME = ("google/protobuf/empty.proto", "google/protobuf/field_mask.proto",
                        "google/protobuf/timestamp.proto")


def _add_file(pool: descriptor_pool.DescriptorPool, path: str, package: str,
              messages: dict[str, list[Field]], dependency: tuple[str, ...] = (),
              enums: dict[str, dict[str, int]] | None = None) -> str:
    """The .proto file `path` (under containerd's api/) of `messages` and `enums`, added to
    `pool`; its name."""
    file = descriptor_pb2.FileDescriptorProto(name=_PROTO + path, package=package,
                                              syntax="proto3", dependency=list(dependency))
    for enum_name, values in (enums or {}).items():
        enum = file.enum_type.add(name=enum_name)
        for name, number in values.items():
            enum.value.add(name=name, number=number)
    for name, fields in messages.items():
        _add_message(file, name, fields)
    pool.Add(file)
    return file.name


def _build_pool() -> descriptor_pool.DescriptorPool:
    pool = descriptor_pool.DescriptorPool()
    for module in (empty_pb2, field_mask_pb2, timestamp_pb2):
        proto = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(proto)
        pool.Add(proto)
    mount = _add_file(pool, "types/mount.proto", TYPES_PACKAGE, MOUNT)
    descriptor = _add_file(pool, "types/descriptor.proto", TYPES_PACKAGE, DESCRIPTOR)
    _add_file(pool, "services/snapshots/v1/snapshots.proto", PACKAGE, MESSAGES,
              (_EMPTY, _MASK, _TIME, mount), {"Kind": KINDS})
    _add_file(pool, "services/leases/v1/leases.proto", LEASES_PACKAGE, LEASE_MESSAGES,
              (_EMPTY, _TIME))
    _add_file(pool, "services/content/v1/content.proto", CONTENT_PACKAGE, CONTENT_MESSAGES,
              (_MASK, _TIME), {"WriteAction": WRITE_ACTIONS})
    _add_file(pool, "services/images/v1/images.proto", IMAGES_PACKAGE, IMAGES_MESSAGES,
              (_MASK, _TIME, descriptor))
    return pool


_POOL = _build_pool()
_CLASSES: dict[str, Any] = {}


def message(name: str, package: str = PACKAGE) -> Any:
    """The message class `name` of `package` (default the snapshots package), or of a full
    name with dots."""
    full = name if "." in name else f"{package}.{name}"
    if full not in _CLASSES:
        _CLASSES[full] = GetMessageClass(_POOL.FindMessageTypeByName(full))
    return _CLASSES[full]


def mount(kind: str, source: str, options: list[str]) -> Any:
    """A containerd.types.Mount."""
    return message(f"{TYPES_PACKAGE}.Mount")(type=kind, source=source, options=options)
