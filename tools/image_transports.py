"""Picking an image transport: `open_image_source(spec)` chooses the registry, an OCI layout
or a docker archive by the spec's skopeo-style prefix (`docker://`, `oci:`,
`docker-archive:`).

Owns only that choice. It lives apart from image_source.py, whose base class every transport
imports, so that imports point one way (transports -> image_source; this module -> the
transports). Each transport is imported when chosen: `requests` only for a registry.
Must not: resolve or read images (image_source.py and the transports do).
"""

from __future__ import annotations

from weenvfs.errors import UsageError

from .image_source import ImageSource, SourceOptions


def open_image_source(spec: str, options: SourceOptions | None = None) -> ImageSource:
    """The source named by `spec`: `docker://HOST/REPO[:TAG|@DIGEST]`, `oci:DIR[:TAG]` or
    `docker-archive:PATH[:REF|@N]`."""
    options = options or SourceOptions()
    transport, sep, rest = spec.partition(":")
    if transport == "docker" and rest.startswith("//"):
        from .registry import RegistrySource

        return RegistrySource(rest[2:], options)
    if sep and transport == "oci":
        from .oci_layout import OciLayoutSource

        return OciLayoutSource.from_spec(rest)
    if sep and transport == "docker-archive":
        from .docker_archive import DockerArchiveSource

        return DockerArchiveSource.from_spec(rest, options)
    raise UsageError(
        f"unknown image source {spec!r:.200}: use docker://HOST/REPO:TAG, oci:DIR[:TAG] "
        "or docker-archive:PATH"
    )
