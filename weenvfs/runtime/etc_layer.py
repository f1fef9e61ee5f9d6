"""The files the runtime gives every sandbox, as Docker does: `/etc/hosts`.

Docker writes each container an /etc/hosts (localhost and the IPv6 names, also with
`--network none`), whatever the image holds; images rarely carry one (a debootstrapped tree has
none), and without it nothing in a sandbox resolves `localhost` (a test suite that starts a
server on it fails). The file lives in a read-only folder stacked over the image as the
overlay's topmost lower, one per node and content version, so it costs no write to the
sandbox's upper (which must stay empty for its root to be parked) and no bind mount (whose
target would have to exist in the image). Its `etc` folder is what the sandbox sees as /etc's
own attributes (overlayfs takes a merged folder's from its topmost layer): mode 0755, root.
With `--network host` the node's /etc/hosts is bound over it (launcher.py), as Docker does.

Owns: the layer's folder and its content. Must not: mount anything (rootfs.py does).
"""

from __future__ import annotations

import os
from pathlib import Path

LAYERS_ROOT = Path("/run/weenv/etc-layer")
VERSION = "v1"  # a new content gets a new folder: overlays over the old one keep theirs
HOSTS = (
    b"127.0.0.1\tlocalhost\n"
    b"::1\tlocalhost ip6-localhost ip6-loopback\n"
    b"fe00::0\tip6-localnet\n"
    b"ff00::0\tip6-mcastprefix\n"
    b"ff02::1\tip6-allnodes\n"
    b"ff02::2\tip6-allrouters\n"
)


def etc_layer(root: Path = LAYERS_ROOT) -> Path:
    """The layer's folder (`etc/hosts` in it), made if missing: complete or not there at all
    (written under another name, renamed into place), so concurrent sandboxes never stack a
    half-made one."""
    layer = root / VERSION
    if (layer / "etc" / "hosts").is_file():
        return layer
    root.mkdir(parents=True, exist_ok=True, mode=0o755)
    staging = root / f".{VERSION}.{os.getpid()}.{os.urandom(4).hex()}"
    try:
        (staging / "etc").mkdir(parents=True, mode=0o755)
        hosts = staging / "etc" / "hosts"
        hosts.write_bytes(HOSTS)
        hosts.chmod(0o644)
        for folder in (staging, staging / "etc"):
            folder.chmod(0o755)  # whatever the umask
        try:
            staging.rename(layer)
        except OSError:  # another sandbox made it first
            if not (layer / "etc" / "hosts").is_file():
                raise
    finally:
        if staging.exists():
            for path in (staging / "etc" / "hosts", staging / "etc", staging):
                if path.is_dir():
                    path.rmdir()
                elif path.exists():
                    path.unlink()
    return layer
