"""The `weenv mounts` command: the node's shared mounts, listed and evicted.

Owns: its arguments and output. `weenv mounts` lists every shared mount of the node
(runtime/mounts.py): key, what it serves (environment, group layer, recording), data path
(kernel: EROFS over a FUSE data device; fuse: the tree served over FUSE), daemon, holders,
idle since and warm until. `weenv mounts evict KEY|--idle|--all [--force]` unmounts them;
`--expired` applies the node's policy (idle timeout, count and memory bounds), as the node's
mount server does every minute and after every release, and first removes the sandboxes whose
owner was killed (what `weenv sandbox gc` would remove first). Must not: mount or unmount
itself (mounts.py, fuse/daemon.py).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from weenvfs.cli import add_command
from weenvfs.cli_args import print_json
from weenvfs.errors import UsageError

Sub = argparse._SubParsersAction  # type: ignore[type-arg]


def register(subparsers: Sub) -> None:
    """Add `mounts` with its subcommands `ls` (the default) and `evict`."""
    p = add_command(
        subparsers, "mounts",
        help="list the node's shared mounts (warm ones too) and evict them",
        description=(
            "List the shared mounts of this node: one per environment or group stack, kept\n"
            "mounted after their last sandbox ends ($WEENV_KEEP_WARM seconds, default 600;\n"
            "at most $WEENV_WARM_MAX idle ones, default 16, and $WEENV_WARM_MEMORY bytes of\n"
            "their daemons, default 1 GiB; least recently used evicted first)."
        ),
        examples=["weenv mounts", "weenv mounts --json | jq '.[].key'",
                  "weenv mounts evict --idle"],
        func=_cmd_ls,
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    sub = p.add_subparsers(title="mounts commands", metavar="COMMAND")
    ls = add_command(sub, "ls", help="list the shared mounts (the default)",
                     description="List the shared mounts of this node.",
                     examples=["weenv mounts ls --json"], func=_cmd_ls)
    ls.add_argument("--json", action="store_true", help="print JSON")
    ev = add_command(
        sub, "evict",
        help="unmount shared mounts no sandbox uses",
        description=(
            "Unmount the shared mount KEY (a key prefix is enough), every idle one (--idle),\n"
            "every one (--all), or those past the node's policy (--expired). A mount that a\n"
            "sandbox holds is refused unless --force (its sandboxes lose their files); the\n"
            "parked roots over the mounts concerned (finished runs' roots kept for the next\n"
            "run, `weenv sandbox ls`) are removed first."
        ),
        examples=["weenv mounts evict 0a1b2c3d4e5f", "weenv mounts evict --idle",
                  "weenv mounts evict --all --force"],
        func=_cmd_evict,
    )
    which = ev.add_mutually_exclusive_group(required=True)
    which.add_argument("key", nargs="?", metavar="KEY", help="the mount's key (or a prefix)")
    which.add_argument("--idle", action="store_true", help="every mount no sandbox holds")
    which.add_argument("--all", action="store_true", help="every mount (see --force)")
    which.add_argument("--expired", action="store_true",
                       help="mounts past their idle timeout or over the node's bounds "
                       "(as root, after the sandboxes whose owner was killed)")
    ev.add_argument("--force", action="store_true", help="unmount mounts with holders too")
    ev.add_argument("--quiet", action="store_true", help="print nothing")


def describe(mount: Any) -> dict[str, Any]:
    """One line of the listing: mounts.MountInfo plus its data path (kernel or fuse)."""
    from weenvfs.fuse import daemon

    row = mount.to_json()
    row["data_path"] = None
    if mount.mounted:
        row["data_path"] = "kernel" if daemon.is_kernel_mount(mount.mountpoint) else "fuse"
    return row


def _cmd_ls(args: argparse.Namespace) -> int:
    from . import mounts

    rows = [describe(m) for m in mounts.list_mounts()]
    if args.json:
        print_json(rows)
        return 0
    print(f"{'KEY':<13} {'SERVES':<22} {'DATA':<6} {'PID':>7} {'HOLDERS':>7}  "
          f"{'IDLE SINCE':<10} WARM UNTIL")
    for row in rows:
        serves = (row["env"] or "?")[:12] + ("" if row["layer"] is None
                                            else f" layer {row['layer']}")
        serves += " recording" if row["record"] else ""
        print(f"{row['key'][:12]:<13} {serves:<22} {row['data_path'] or '-':<6} "
              f"{row['pid'] or '-':>7} {len(row['holders']):>7}  "
              f"{_ago(row['idle_since']):<10} {_until(row['warm_until'])}")
    return 0


def _ago(when: float | None) -> str:
    return "-" if when is None else f"{max(0.0, time.time() - when):.0f}s ago"


def _until(when: float | None) -> str:
    return "-" if when is None else f"in {max(0.0, when - time.time()):.0f}s"


def _cmd_evict(args: argparse.Namespace) -> int:
    from . import mounts, sandbox_state

    if args.expired:
        if _is_root():  # (this node root's own: another root's housekeeping keeps its own)
            _drop_parked(expired_only=True, own_root=True)
            _remove_ownerless()
        evicted = mounts.evict_idle(is_live=sandbox_state.exists if _is_root() else None)
    else:
        listed = mounts.list_mounts()
        if args.key is not None:
            if not args.key:
                raise UsageError("an empty key names no mount (see `weenv mounts` for keys)")
            chosen = [m for m in listed if m.key.startswith(args.key.lower())]
            if not chosen:
                raise UsageError(f"no shared mount has key {args.key!r} (see `weenv mounts`)")
            if len(chosen) > 1:
                raise UsageError(f"key prefix {args.key!r} names {len(chosen)} mounts")
        # A parked root (a finished sandbox's, kept for the next run) gives its mounts up
        # first: it is the node's cache, not a sandbox anyone runs.
        # (Only those over this node root's mounts: $WEENV_ENVS_ROOT may name another.)
        keys = {m.key for m in (chosen if args.key is not None else listed)}
        if _is_root() and _drop_parked(keys=keys, own_root=True):
            listed = mounts.list_mounts()
        if args.key is not None:
            chosen = [m for m in listed if m.key in keys]
        else:
            chosen = [m for m in listed if args.all or not m.holders]
        evicted = [m.key for m in chosen if mounts.evict(m.key, force=args.force)]
    if not args.quiet:
        for key in evicted:
            print(f"evicted {key}")
    return 0


def _drop_parked(**which: Any) -> list[str]:
    from .sandbox import drop_parked  # the node service has it imported (not gc.py's imports)

    return drop_parked(**which)


def _remove_ownerless() -> None:
    """Remove the sandboxes whose owner was killed (a `weenv run` in its own process, sent
    SIGKILL: nothing of it could clean up), so that they go within a housekeeping period,
    not at the next `weenv sandbox gc`. gc.py is imported only when there is one."""
    from .sandbox import ownerless

    found = ownerless(own_root=True)
    if found:
        from .gc import remove_orphans

        remove_orphans(found)


def _is_root() -> bool:
    import os

    return os.geteuid() == 0
