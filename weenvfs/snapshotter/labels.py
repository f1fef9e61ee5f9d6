"""The containerd label names the snapshotter and `weenv pull` share.

Owns: the names. Must not: import anything (`weenv pull` imports this, not the snapshotter's
modules, which load the runtime).
"""

TARGET_LABEL = "containerd.io/snapshot.ref"  # the chain ID a remote Prepare is for
REMOTE_LABEL = "containerd.io/snapshot/remote"  # set on WeEnv snapshots, as stargz does
REMOTE_VALUE = "weenv"
INHERITED_PREFIX = "containerd.io/snapshot/"  # what containerd passes on as snapshot labels
EXPIRE_LABEL = "containerd.io/gc.expire"  # RFC 3339; containerd's collector honours it
