"""Prefetch hints recorded at publish time by `weenv compose` and `weenv convert`, as
`ctr-remote image optimize` does.

Owns:
- `--hint-command CMD`: running `weenv run --record-hint --store URL DIGEST /bin/sh -c CMD` in
  a subprocess once the environment is published: CMD runs in a sandbox of the new
  environment, its reads are recorded and merged into the environment's hint `latest`, and
  `weenv run` says so in one line on stderr. CMD's output goes to stderr, so that stdout stays
  the command's own result (a digest, or JSON).
- the seed hint (`record_seed`, by default; `--no-seed-hint`): the image's own command
  (entrypoint and cmd: an interpreter, a shell) runs the same way (`--record-tag seed`) with
  no input for at most SEED_TIMEOUT seconds, and what it read (its start-up) becomes the hint
  tagged `seed` (SPEC.md 9.4), packed. An environment's first run, which has no hint
  `latest` yet, replays the seed while it records its own (runtime/mounts.py), which then
  holds the seed's reads.

Must not: import the runtime (tools sit below it: the sandbox is reached through the `weenv`
command, never imported), or record anything itself.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

from weenvfs.errors import RefNotFound, UsageError, WeenvError
from weenvfs.format.errors import FormatError
from weenvfs.format.refs import DEFAULT_TAG, SEED_TAG
from weenvfs.store import open_store
from weenvfs.store.repository import Repository
from weenvfs.switches import switched_off

log = logging.getLogger(__name__)

# How long the image's own command may run for the seed: an interpreter or a shell with no
# input starts and ends in a second or two; a server would run until stopped.
SEED_TIMEOUT = 10.0
STOP_TIMEOUT = 60.0  # seconds `weenv run` has to clean up after SIGTERM (then SIGKILL)
# The image's command is nobody's choice here, so its sandbox is bounded besides having no
# network (the default): its writes stay in a small tmpfs, its memory and processes capped.
SEED_LIMITS = ("--tmpfs-upper", "--disk", "256M", "--memory", "2G", "--pids", "1024")
# "off": no hint is recorded by default on this node, the seed neither (runtime/recording.py
# SWITCH_ENV; tools sit below the runtime and do not import it).
RECORD_SWITCH = "WEENV_RECORD_HINTS"
SEED_SWITCH = "WEENV_SEED_HINT"  # "off": as --no-seed-hint (the tests but those of seeds)


def add_hint_command_argument(p: argparse.ArgumentParser) -> None:
    """Add `--hint-command CMD`, `--no-seed-hint` and `--hint-cache DIR`."""
    p.add_argument("--hint-command", metavar="CMD",
                   help="after publishing, run CMD (with /bin/sh -c) in a sandbox of the new "
                   "environment and publish what it read as the environment's prefetch hint "
                   "(needs root, like `weenv run`)")
    p.add_argument("--no-seed-hint", dest="seed_hint", action="store_false",
                   help="do not record the seed hint: by default (as root, without "
                   "--hint-command) the image's own command runs in a sandbox of the new "
                   f"environment, with no input, for at most {SEED_TIMEOUT:g} s, and what it "
                   "read is replayed by the environment's first runs")
    p.add_argument("--hint-cache", type=Path, metavar="DIR",
                   help="the node chunk cache the --hint-command sandbox uses (default: as "
                   "`weenv run`)")


def check_hint_command(args: argparse.Namespace) -> None:
    """Fail before anything is published when --hint-command cannot run here."""
    if args.hint_command is not None and os.geteuid() != 0:
        raise UsageError("--hint-command runs CMD in a sandbox: run as root")
    if args.hint_command is not None and not args.hint_command.strip():
        raise UsageError("--hint-command: empty command")


def record_after_publish(args: argparse.Namespace, digest: str,
                         quiet: bool) -> dict[str, str | None] | None:
    """What `weenv convert` and `weenv compose` record once environment `digest` is
    published: --hint-command's hint, else the seed (its lines on stderr unless `quiet`).
    The seed's outcome, `{"hint": digest or None, "said": line}`, for a --json result; None
    when no seed was tried."""
    sys.stdout.flush()  # a result printed before: what the sandbox says follows on stderr
    if args.hint_command is not None:
        record_hint(args.store, digest, args.hint_command, args.hint_cache)
        return None
    if not wants_seed(args):
        return None
    if not quiet:
        print(f"recording the seed hint: the image's command, at most {SEED_TIMEOUT:g} s "
              "(--no-seed-hint skips this)", file=sys.stderr, flush=True)
    hint, line = record_seed(args.store, digest, args.hint_cache)
    if not quiet:
        print(line, file=sys.stderr)
    return {"hint": hint, "said": line}


def wants_seed(args: argparse.Namespace) -> bool:
    """Whether to record the seed hint: asked (the default), no --hint-command (whose hint is
    the environment's own), recording not switched off on this node, and root (else said at
    info level)."""
    if not args.seed_hint or args.hint_command is not None:
        return False
    for switch in (SEED_SWITCH, RECORD_SWITCH):
        if switched_off(switch):
            log.info("no seed hint: $%s is off", switch)
            return False
    if os.geteuid() != 0:
        log.info("no seed hint: the image's command runs in a sandbox, which needs root")
        return False
    return True


def _run_argv(url: str, digest: str, cache: Path | None, *options: str) -> list[str]:
    return [sys.executable, "-m", "weenvfs", "run", "--record-hint", *options, "--store", url,
            *(["--cache", str(cache.absolute())] if cache is not None else []), digest]


def _url(store: str) -> str:
    is_url = "://" in store or store[:5].lower() == "file:"  # as weenvfs.fuse.config.is_url
    return store if is_url else os.path.abspath(store)


def record_seed(store: str, digest: str, cache: Path | None,
                timeout: float = SEED_TIMEOUT) -> tuple[str | None, str]:
    """Record the seed hint of environment `digest` (see the module): (its hint digest or
    None, one line saying what happened). The seed's own failures are that line, never an
    exception: the environment is published already."""
    try:
        return _record_seed(_url(store), digest, cache, timeout)
    except (WeenvError, FormatError, OSError) as error:
        return None, f"no seed hint: {' '.join(str(error).split())}"


def _record_seed(url: str, digest: str, cache: Path | None,
                 timeout: float) -> tuple[str | None, str]:
    with open_store(url) as opened:
        repo = Repository(opened)
        _, manifest = repo.resolve_env(digest)
        if not (manifest.config.entrypoint or manifest.config.cmd):
            return None, "no seed hint: the image has no entrypoint or cmd"
        for tag in (DEFAULT_TAG, SEED_TAG):
            if _tagged(repo, digest, tag):
                return None, f"no seed hint recorded: the environment has a hint {tag} already"
    command = " ".join((*manifest.config.entrypoint, *manifest.config.cmd))
    log.info("recording the seed hint from %r (at most %g s)", command, timeout)
    # Packed below, not in the background: the result names the packed hint.
    env = {**os.environ, "WEENV_HINT_PACK": "off"}
    argv = _run_argv(url, digest, cache, "--record-tag", SEED_TAG, *SEED_LIMITS)
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        _, err = proc.communicate(timeout=timeout)
        stopped = False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # `weenv run` ends the sandbox and publishes
        try:
            _, err = proc.communicate(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        stopped = True
    with open_store(url) as opened:
        hint = _tagged(Repository(opened), digest, SEED_TAG)
    if hint is None:
        last = (err or b"").decode(errors="replace").strip().splitlines()[-1:]
        return None, ("no seed hint: the image's command published none"
                      + (f" ({last[0]})" if last else ""))
    packed = subprocess.run(
        [sys.executable, "-m", "weenvfs", "hints", "pack", digest, "--store", url, "--tag",
         SEED_TAG, *(["--cache", str(cache.absolute())] if cache is not None else [])],
        stdin=subprocess.DEVNULL, capture_output=True, check=False)
    if packed.returncode:
        log.warning("the seed hint was not packed: %s",
                    packed.stderr.decode(errors="replace").strip())
    with open_store(url) as opened:  # packing published the hint again, with its pack
        hint = _tagged(Repository(opened), digest, SEED_TAG) or hint
    how = f"stopped after {timeout:g} s" if stopped else f"exit status {proc.returncode}"
    return hint, (f"seed hint {hint[:12]} recorded from the image's command `{command}` "
                  f"({how}): first runs replay it until the environment has a hint of its own")


def _tagged(repo: Repository, digest: str, tag: str) -> str | None:
    try:
        return repo.get_tag("hints", digest, tag)
    except RefNotFound:
        return None


def record_hint(store: str, digest: str, command: str, cache: Path | None) -> None:
    """Run `command` in a sandbox of environment `digest` of `store`, recording its hint;
    WeenvError if no hint was published."""
    url = _url(store)
    argv = [*_run_argv(url, digest, cache, "--entrypoint", ""), "/bin/sh", "-c", command]
    log.info("recording a hint with %s", argv)
    done = subprocess.run(argv, stdout=sys.stderr.fileno(), check=False)
    if done.returncode:
        log.warning("--hint-command exited with status %d; what it read is recorded anyway",
                    done.returncode)
    with open_store(url) as opened:
        try:
            Repository(opened).get_tag("hints", digest, "latest")
        except RefNotFound:
            raise WeenvError("--hint-command: no hint was published (see the lines "
                             "above)") from None
