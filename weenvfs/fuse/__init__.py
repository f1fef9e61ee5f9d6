"""The FUSE side of a mount: the pyfuse3 adapter (ops.py), its errno table (errno_map.py), the
mount lifecycle (mount.py), the background daemon (daemon.py; the copies other mount
namespaces hold of its mounts: mount_copies.py), the node service (mountd.py,
with the children it forks: service_forks.py, the evictions it runs: service_evictions.py,
the code it loads for them once it listens: service_loading.py, and what it prepares for
its next children: service_preload.py) and its metrics
(stats_channel.py, metrics.py, exporter.py), and the commands (commands.py).

Imports point one way: this package uses `weenvfs.core` for everything the file system means,
and `weenvfs.store.open_store` to reach the store; nothing below it imports it. Importing this
package is cheap (no pyfuse3, no trio) so that `weenv umount` and `weenv stats` start fast.
"""

from __future__ import annotations

#: The virtual xattr of a mount's root directory that holds its statistics (JSON).
STATS_XATTR = b"user.weenv.stats"
