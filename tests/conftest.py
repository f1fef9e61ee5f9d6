"""Suite-wide test policy: log hygiene, faulthandler, and skips that CI turns into failures.

Owns:
- log hygiene: a test fails if a logger under `weenvfs` emits a WARNING or worse that the test
  did not declare with the `assert_logs(pattern, count=None)` fixture;
- `require_or_skip(condition, reason)`: skip with a reason, or fail when WEENVFS_TEST_STRICT=1
  (set by .ci/run), so a missing component can never make CI pass silently;
- FUSE: the `requires_fuse` marker and fixture skip when /dev/fuse or fusermount3 is unusable,
  and fail instead when WEENVFS_TEST_FUSE=1;
- SIGINT at its default in the commands the tests start, however the suite was started (a
  background job of a shell without job control gets it ignored);
- isolation from the node: $WEENV_MOUNTD_SOCKET points into a folder of this session, so a
  mount server running on the machine (`weenv mountd`) never serves the tests' mounts; the
  server the first mount of the session starts there (mounts start one when none answers) is
  stopped by pid when the session ends; tests of the server start their own
  (tests/fuse/test_mountd.py). $WEENV_KEEP_WARM is 0 unless set: a shared mount is unmounted
  when its last sandbox goes, as tests of sandboxes expect (tests of warm mounts opt in).
  $WEENV_METRICS and $WEENV_SNAPSHOTTER_METRICS are off: no server of the tests exports
  metrics unless its test asks.
It must not start servers or build fixtures of any area; those live in tests/<area>/conftest.py.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import re
import shutil
import signal
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# pytest's own faulthandler plugin normally does this; keep it on if that plugin is disabled.
if not faulthandler.is_enabled():
    faulthandler.enable()

# A shell without job control starts a background command (`make test &`, `nohup ... &`) with
# SIGINT ignored, every process it starts inherits that, and a Python started with SIGINT
# ignored never raises KeyboardInterrupt: the Ctrl-C tests (tests/fuse/test_mount_interrupt.py,
# tests/runtime/test_interrupts.py) would then wait for commands that cannot be interrupted.
# A terminal's Ctrl-C reaches them with SIGINT at its default; so do the tests' commands.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

WATCHED_LOGGER = "weenvfs"

os.environ["WEENV_MOUNTD_SOCKET"] = os.path.join(
    tempfile.mkdtemp(prefix="weenv-tests-mountd-"), "mountd.sock")
os.environ.setdefault("WEENV_KEEP_WARM", "0")
# The servers the tests' mounts start export no metrics (the node's port is not theirs);
# tests of the metrics choose an address (tests/fuse/test_metrics.py); so do the
# snapshotter's (tests/support/containerd.py).
os.environ["WEENV_METRICS"] = "off"
os.environ["WEENV_SNAPSHOTTER_METRICS"] = "off"
# Recording mounts pack what they publish in a background process, which moves the hint tag
# while a test checks it; tests of packing turn it on (tests/core/test_hint_pack.py).
os.environ["WEENV_HINT_PACK"] = "off"
# `weenv convert` and `compose` record a seed hint from the image's command by default (a
# sandbox run of up to 10 s each); tests of the seed turn it on (tests/runtime/test_seed_hint.py).
os.environ["WEENV_SEED_HINT"] = "off"
_SESSION_SOCKET = os.environ["WEENV_MOUNTD_SOCKET"]


@pytest.fixture(scope="session", autouse=True)
def _session_mount_server() -> Iterator[None]:
    """At the end of the session, stop the mount server its mounts started (by its pid)."""
    yield
    try:
        with open(_SESSION_SOCKET + ".pid") as f:
            pid = int(f.read())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"mountd" not in f.read().replace(b"\0", b" ").split():  # words or a title
                return
    except (OSError, ValueError):
        return
    for signum in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
        deadline = time.monotonic() + 30
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not _running(pid):
            return


def _running(pid: int) -> bool:
    """Whether `pid` runs (a zombie, which init may reap late, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def strict() -> bool:
    """True when every `require_or_skip` skip must be a failure (CI)."""
    return _env_flag("WEENVFS_TEST_STRICT")


def _skip_or_fail(reason: str, *, fail: bool, flag: str) -> None:
    if fail:
        pytest.fail(f"{reason} ({flag}=1 makes this a failure, not a skip)", pytrace=False)
    pytest.skip(reason)


def require_or_skip(condition: object, reason: str) -> None:
    """Skip the running test with `reason` unless `condition` holds; fail instead if strict."""
    if not condition:
        _skip_or_fail(reason, fail=strict(), flag="WEENVFS_TEST_STRICT")


def fuse_unavailable_reason() -> str | None:
    """Why FUSE mounts cannot work here, or None when they can."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse does not exist"
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except OSError as error:
        return f"cannot open /dev/fuse: {error.strerror}"
    fusermount = shutil.which("fusermount3")
    if fusermount is None:
        return "fusermount3 not found (Debian package fuse3)"
    if os.geteuid() != 0 and not os.stat(fusermount).st_mode & stat.S_ISUID:
        return f"{fusermount} is not setuid root"
    try:
        import pyfuse3  # noqa: F401
    except ImportError as error:
        return f"cannot import pyfuse3: {error}"
    return None


def fuse_available() -> bool:
    """True when FUSE mounts can work on this machine."""
    return fuse_unavailable_reason() is None


def _require_fuse() -> None:
    reason = fuse_unavailable_reason()
    if reason is not None:
        _skip_or_fail(
            f"FUSE unusable: {reason}",
            fail=_env_flag("WEENVFS_TEST_FUSE"),
            flag="WEENVFS_TEST_FUSE",
        )


# --- log hygiene ------------------------------------------------------------------------------


@dataclass
class _Expectation:
    pattern: re.Pattern[str]
    level: int
    records: list[logging.LogRecord] = field(default_factory=list)

    def claims(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.level and bool(self.pattern.search(record.getMessage()))


class _LogChecker(logging.Handler):
    """Collects WARNING+ records of `weenvfs.*` that no active expectation claims."""

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.expectations: list[_Expectation] = []
        self.unexpected: list[logging.LogRecord] = []
        self.reported = 0

    def emit(self, record: logging.LogRecord) -> None:
        # Innermost assert_logs block first, so nested declarations work as expected.
        for expectation in reversed(self.expectations):
            if expectation.claims(record):
                expectation.records.append(record)
                return
        if record.levelno >= logging.WARNING:
            self.unexpected.append(record)

    def take_new(self) -> list[logging.LogRecord]:
        new = self.unexpected[self.reported :]
        self.reported = len(self.unexpected)
        return new


def _describe(records: list[logging.LogRecord]) -> str:
    return "\n".join(f"  {r.levelname} {r.name}: {r.getMessage()}" for r in records)


def _check_logs(checker: _LogChecker, when: str) -> None:
    new = checker.take_new()
    if new:
        pytest.fail(
            f"unexpected log records {when} (declare expected ones with assert_logs):\n"
            + _describe(new),
            pytrace=False,
        )


_CHECKER_KEY = pytest.StashKey[_LogChecker]()


@pytest.fixture(autouse=True)
def _log_hygiene(request: pytest.FixtureRequest) -> Iterator[_LogChecker]:
    checker = _LogChecker()
    logger = logging.getLogger(WATCHED_LOGGER)
    logger.addHandler(checker)
    request.node.stash[_CHECKER_KEY] = checker
    try:
        yield checker
    finally:
        logger.removeHandler(checker)
    # Records logged while fixtures were torn down (e.g. an unmount) are still checked.
    _check_logs(checker, "during fixture teardown")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """Fail the test itself (not its teardown) when its body logged something unexpected."""
    result = yield
    checker = item.stash.get(_CHECKER_KEY, None)
    if checker is not None:
        _check_logs(checker, "in the test")
    return result


AssertLogs = Callable[..., contextlib.AbstractContextManager[list[logging.LogRecord]]]


@pytest.fixture
def assert_logs(_log_hygiene: _LogChecker) -> AssertLogs:
    """Context manager declaring log lines the block must emit (regex `pattern`, searched).

    `count=None` means at least one; an int means exactly that many. `level` is the lowest
    level matched (default WARNING; lower levels are enabled on `weenvfs` for the block).
    Yields the list of matching records for further checks.
    """

    @contextlib.contextmanager
    def expect(
        pattern: str, count: int | None = None, level: int = logging.WARNING
    ) -> Iterator[list[logging.LogRecord]]:
        expectation = _Expectation(re.compile(pattern), level)
        logger = logging.getLogger(WATCHED_LOGGER)
        old_level = logger.level
        if logger.getEffectiveLevel() > level:
            logger.setLevel(level)
        _log_hygiene.expectations.append(expectation)
        try:
            yield expectation.records
        finally:
            _log_hygiene.expectations.remove(expectation)
            logger.setLevel(old_level)
        seen = len(expectation.records)
        if (seen == 0) if count is None else (seen != count):
            wanted = "at least 1" if count is None else str(count)
            pytest.fail(
                f"expected {wanted} log record(s) matching {pattern!r}, got {seen}"
                + (":\n" + _describe(expectation.records) if seen else ""),
                pytrace=False,
            )

    return expect


@pytest.fixture(name="require_or_skip")
def require_or_skip_fixture() -> Callable[[object, str], None]:
    """`require_or_skip(condition, reason)` as a fixture, for tests in any folder."""
    return require_or_skip


@pytest.fixture(scope="session")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """native/weenv-launch.c built for this run's interpreter (tests/support/launcher.py)."""
    from support.launcher import build_launcher

    built = build_launcher(tmp_path_factory.mktemp("launcher"))
    require_or_skip(built, "no C compiler for native/weenv-launch.c (Debian gcc)")
    assert built is not None
    return built


@pytest.fixture(name="requires_fuse")
def requires_fuse_fixture() -> None:
    """Skip (or fail with WEENVFS_TEST_FUSE=1) unless FUSE mounts can work here."""
    _require_fuse()


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("requires_fuse") is not None:
        _require_fuse()


def pytest_report_header(config: pytest.Config) -> list[str]:
    reason = fuse_unavailable_reason()
    return [
        f"weenvfs: FUSE {'usable' if reason is None else 'unusable: ' + reason}; "
        f"WEENVFS_TEST_FUSE={os.environ.get('WEENVFS_TEST_FUSE', '')!r} "
        f"WEENVFS_TEST_STRICT={os.environ.get('WEENVFS_TEST_STRICT', '')!r}"
    ]
