"""A throw-away Docker registry on 127.0.0.1, for tests, benchmarks and trying `weenv convert
docker://...` and `weenv push` on one machine.

Owns: finding Debian's `docker-registry` (the CNCF Distribution registry), writing its
config.yml (filesystem storage in our folder, deletes enabled, a quiet log, a random HTTP
secret) and, for basic auth, its htpasswd file (bcrypt: the only hash it accepts); picking a
free loopback port; starting `docker-registry serve` and waiting until `/v2/` answers (its
process and folder are handled as for every local server, store/local_server.py: stopped by
pid, SIGTERM then SIGKILL, a temp folder removed); copying an OCI layout into it with skopeo
(`push`).

Must not: listen beyond 127.0.0.1 (benchmarks/docker_peer.py subclasses it to run inside a
private network namespace, reachable only through that namespace's link), serve as a
production registry (no TLS, one process, data in one folder), or touch a registry it did not
start.
"""

from __future__ import annotations

import http.client
import logging
import secrets
import shutil
import socket
import subprocess
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Self

from weenvfs.errors import WeenvError
from weenvfs.store.local_server import LocalServer, free_ports

log = logging.getLogger(__name__)

BINARY = "docker-registry"
REALM = "weenv-registry"
START_TIMEOUT = 30.0  # seconds until /v2/ answers
_CONFIG = """\
version: 0.1
log:
  level: error
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: {root}
  delete:
    enabled: true
http:
  addr: {addr}
  secret: {secret}
"""
_AUTH = """\
auth:
  htpasswd:
    realm: {realm}
    path: {path}
"""


def registry_missing() -> str | None:
    """Why the registry cannot run here, or None."""
    if shutil.which(BINARY) is None:
        return f"{BINARY} not found (Debian package docker-registry)"
    return None


def htpasswd_lines(users: Mapping[str, str]) -> str:
    """htpasswd lines of `users` (name -> password) with bcrypt hashes."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            import crypt  # glibc's libxcrypt does bcrypt ($2b$); gone in Python 3.13
    except ImportError:
        raise WeenvError("basic auth needs Python's crypt module (Python 3.12 or older) "
                         "to make bcrypt hashes") from None
    return "".join(f"{user}:{crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH))}\n"
                   for user, password in users.items())


class RegistryServer(LocalServer):
    """One `docker-registry serve` process: `start()` (or `with`), then `host`, `url`,
    `push()`; `stop()` ends it and, if the folder was a temp folder, deletes its data.

    `directory`: where data (`data/`), config, htpasswd and the log go (default: a new temp
    folder, removed at stop; a given folder is kept, and so is what was pushed). `port`: fixed
    port (default: a free one). `users`: name -> password; when given, every request needs
    HTTP basic auth from one of them.
    """

    ip = "127.0.0.1"  # where it listens (a subclass in a private network namespace changes it)

    def __init__(self, directory: Path | str | None = None, *, port: int | None = None,
                 users: Mapping[str, str] | None = None) -> None:
        super().__init__(directory, "weenv-registry-")
        self._fixed_port = port
        self.port = port or 0
        self.users = dict(users) if users is not None else None

    # -- addresses -------------------------------------------------------------------------

    @property
    def host(self) -> str:
        """`IP:PORT`, as image references name the registry (`HOST/REPO:TAG`)."""
        return f"{self.ip}:{self.port}"

    @property
    def url(self) -> str:
        """The registry's base URL, e.g. `http://127.0.0.1:5000`."""
        return f"http://{self.host}"

    @property
    def data(self) -> Path:
        """The storage folder (blobs, manifests, repositories)."""
        return self.directory / "data"

    @property
    def log_path(self) -> Path:
        """The registry's log (its output, appended at every start)."""
        return self.directory / "registry.log"

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, timeout: float = START_TIMEOUT) -> Self:
        """Start the registry and return when `/v2/` answers; WeenvError if it cannot. It
        gets SIGTERM when the thread that started it ends (Linux PR_SET_PDEATHSIG)."""
        missing = registry_missing()
        if missing:
            raise WeenvError(missing)
        if self._fixed_port:
            _check_free(self.ip, self._fixed_port)
        self.data.mkdir(parents=True, exist_ok=True)
        attempts = 1 if self._fixed_port else 3  # a picked port may be taken meanwhile
        for attempt in range(attempts):
            self.port = self._fixed_port or free_ports(1)[0]
            self._spawn()
            try:
                self._wait_ready(time.monotonic() + timeout)
                break
            except _Exited as e:
                self._reap()
                if attempt == attempts - 1:
                    raise WeenvError(f"{BINARY} did not start on {self.host}: {e}") from None
                log.info("%s exited at start (%s); retrying with another port", BINARY, e)
        log.info("registry at %s (%s)", self.url, self.directory)
        return self

    def _spawn(self) -> None:
        config = self.directory / "registry.yml"
        text = _CONFIG.format(root=self.data, addr=self.host, secret=secrets.token_hex(16))
        if self.users is not None:
            htpasswd = self.directory / "htpasswd"
            htpasswd.write_text(htpasswd_lines(self.users))
            text += _AUTH.format(realm=REALM, path=htpasswd)
        config.write_text(text)
        config.chmod(0o600)  # the HTTP secret
        self._popen(self._command(config), self.log_path)

    def _command(self, config: Path) -> list[str]:
        return [BINARY, "serve", str(config)]

    def _wait_ready(self, deadline: float) -> None:
        """Poll `/v2/` until it answers: 200, or 401 when basic auth is on."""
        while True:
            if self.process is None or self.process.poll() is not None:
                raise _Exited(self._log_tail())
            try:
                conn = http.client.HTTPConnection(self.ip, self.port, timeout=2)
                try:
                    conn.request("GET", "/v2/")
                    if conn.getresponse().status in (200, 401):
                        return
                finally:
                    conn.close()
            except OSError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                self.stop()
                raise WeenvError(f"{BINARY} did not answer {self.url}/v2/ in time; "
                                 f"see {self.log_path}")
            time.sleep(0.05)

    def _log_tail(self, chars: int = 300) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "no log"
        return " ".join(text[-chars:].split()) or "exited without a message"

    # -- use -------------------------------------------------------------------------------

    def push(self, layout: Path | str, tag: str, repo: str, dest_tag: str | None = None) -> str:
        """Copy image `tag` of OCI layout `layout` to `repo:dest_tag` (default: `tag`) with
        skopeo (Debian package), as the first user when basic auth is on; the reference."""
        ref = f"{self.host}/{repo}:{dest_tag or tag}"
        creds = []
        if self.users:
            user, password = next(iter(self.users.items()))
            creds = [f"--dest-creds={user}:{password}"]
        if shutil.which("skopeo") is None:
            raise WeenvError("skopeo not found (Debian package skopeo)")
        done = subprocess.run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false", *creds,
                               f"oci:{layout}:{tag}", f"docker://{ref}"],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise WeenvError(f"skopeo could not push {layout}:{tag} to {ref}: "
                             f"{' '.join(done.stderr.split())[-500:]}")
        return ref


def _check_free(ip: str, port: int) -> None:
    """WeenvError unless `ip:port` can be listened on now (SO_REUSEADDR, as the registry binds
    it: a closed connection's TIME_WAIT does not count, a listener does)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip, port))
        except OSError as e:
            raise WeenvError(f"cannot listen on {ip}:{port}: {(e.strerror or str(e)).lower()}"
                             ) from None


class _Exited(Exception):
    """The registry exited before it answered."""

