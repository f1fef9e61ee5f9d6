"""Fixtures of the snapshotter tests, defined in tests/support/containerd.py: `node` (module:
a store, a registry, `weenv snapshotter` and containerd 1.6, all of their own) and
`containerd_requirements` (skip with the reason where they cannot run)."""

from __future__ import annotations

from support.containerd import (  # noqa: F401  (pytest finds fixtures by name here)
    containerd_requirements,
    node,
)
