"""The environment runtime: sandboxes over shared lazy mounts, `weenv run`, and the Python API.

Modules, bottom up:
- `rootfs`: overlay/tmpfs mounts through libc, safe file access inside a root, image users;
- `safe_paths`: the paths the OCI runtime and WeEnv use inside a root, checked against hostile
  images;
- `seccomp`: the syscall filter (Docker's default profile as data) and user profiles;
- `disk`: a size-limited upper (`--disk`): an ext4 image on a loop device;
- `launcher`: the one interface over the isolating program (an OCI runtime, a generated spec),
  and runc's; `crun`: crun's; `runtimes`: which one a sandbox uses (crun where installed);
- `mounts`: shared FUSE mounts on a node, one per key, reference-counted;
- `lowers`: which mounts make a sandbox's lower (one per group, stacked, or one merged);
- `cgroups`: limits, the cgroup hook every start of an init goes through, cgroup files;
- `elastic`: elastic sandboxes, handed to the node's provisioner (weenvfs.provision);
- `sandbox`: one sandbox's state, build, reset and teardown;
- `environment`: `Environment` / `AsyncEnvironment`, the API for RL frameworks;
- `gc`: removal of what crashed controllers left; `commands`: `weenv run` and `weenv sandbox`.

Importing this package is cheap: the names below load their module on first use.
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False  # typing itself is not cheap (2 ms of every `weenv run`'s stand-in)
if TYPE_CHECKING:
    from typing import Any

__all__ = ["AsyncEnvironment", "Environment", "ExecResult", "Limits", "Sandbox",
           "SandboxBroken"]

_WHERE = {
    "AsyncEnvironment": "environment",
    "Environment": "environment",
    "ExecResult": "environment",
    "Limits": "cgroups",
    "Sandbox": "sandbox",
    "SandboxBroken": "sandbox",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
