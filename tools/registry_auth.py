"""Registry credentials and the Distribution auth handshake.

Owns: finding credentials (`--creds USER:PASS`, else the standard Docker config
`$DOCKER_CONFIG/config.json` or `~/.docker/config.json`, else `$REGISTRY_AUTH_FILE` or
`$XDG_RUNTIME_DIR/containers/auth.json` as skopeo/podman write them: `auths` entries with a
base64 `auth` or `username`/`password`); parsing `WWW-Authenticate` challenges; and
`Authenticator.answer(challenge)`, which turns a 401 into the Authorization header to retry
with: Basic with the credentials, or Bearer with a token from the challenge's realm
(`?service=...&scope=...`, basic credentials sent when there are any).

Must not: send credentials in clear to a non-loopback host unless the user allowed plain HTTP
there (`insecure_remote`), or log them.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import json
import logging
import os
import re
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from weenvfs.errors import SourceError, UsageError

log = logging.getLogger(__name__)

_PARAM = re.compile(r'\s*([A-Za-z][A-Za-z0-9_-]*)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^\s,]*))\s*,?')
_DOCKER_HUB_KEYS = (
    "https://index.docker.io/v1/",
    "index.docker.io",
    "docker.io",
    "registry-1.docker.io",
)
TOKEN_TIMEOUT = (10.0, 60.0)


def host_name(host: str) -> str:
    """The name of `host` ('name', 'name:port', '[v6]:port') without its port."""
    if host.startswith("["):
        return host[1 : host.find("]")]
    return host.partition(":")[0] if host.count(":") == 1 else host


def is_loopback(host: str) -> bool:
    """Whether `host` ('name', 'name:port', '[v6]:port') is this machine."""
    name = host_name(host)
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def parse_creds(text: str) -> tuple[str, str]:
    """'USER:PASS' -> (user, password)."""
    user, sep, password = text.partition(":")
    if not sep or not user:
        raise UsageError("--creds must be USER:PASS")
    return user, password


def _config_files() -> list[Path]:
    files = []
    docker = os.environ.get("DOCKER_CONFIG")
    files.append(Path(docker) / "config.json" if docker else Path.home() / ".docker/config.json")
    if os.environ.get("REGISTRY_AUTH_FILE"):
        files.append(Path(os.environ["REGISTRY_AUTH_FILE"]))
    if os.environ.get("XDG_RUNTIME_DIR"):
        files.append(Path(os.environ["XDG_RUNTIME_DIR"]) / "containers/auth.json")
    return files


def _keys(host: str) -> list[str]:
    keys = [host, f"https://{host}", f"http://{host}", f"https://{host}/v1/", f"https://{host}/v2/"]
    if host in _DOCKER_HUB_KEYS:
        keys += list(_DOCKER_HUB_KEYS)
    return keys


def config_creds(host: str) -> tuple[str, str] | None:
    """Credentials for `host` from the standard config files, or None."""
    for path in _config_files():
        try:
            obj = json.loads(path.read_bytes())
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:
            log.warning("ignoring unreadable credentials file %s: %s", path, e)
            continue
        auths = obj.get("auths") if isinstance(obj, dict) else None
        if not isinstance(auths, dict):
            continue
        for key in _keys(host):
            entry = auths.get(key)
            if isinstance(entry, dict):
                creds = _entry_creds(entry, path)
                if creds is not None:
                    log.info("using credentials for %s from %s", host, path)
                    return creds
        if obj.get("credsStore") or obj.get("credHelpers"):
            log.info("%s names credential helpers; weenv reads only 'auths' entries", path)
    return None


def _entry_creds(entry: dict[str, Any], path: Path) -> tuple[str, str] | None:
    if isinstance(entry.get("username"), str) and isinstance(entry.get("password"), str):
        return entry["username"], entry["password"]
    auth = entry.get("auth")
    if not isinstance(auth, str) or not auth:
        return None
    try:
        user, sep, password = base64.b64decode(auth, validate=True).decode().partition(":")
    except (binascii.Error, ValueError):
        raise SourceError(
            f"credentials file {path}: an 'auth' entry is not base64 USER:PASS"
        ) from None
    return (user, password) if sep else None


@dataclass(frozen=True)
class Challenge:
    """A parsed `WWW-Authenticate` header: scheme (lowercase) and parameters."""

    scheme: str
    params: dict[str, str]

    @classmethod
    def parse(cls, header: str) -> Challenge:
        scheme, _, rest = header.strip().partition(" ")
        params: dict[str, str] = {}
        pos = 0
        while pos < len(rest):
            m = _PARAM.match(rest, pos)
            if m is None or m.end() == pos:
                break
            value = m.group(2) if m.group(2) is not None else m.group(3)
            params[m.group(1).lower()] = re.sub(r"\\(.)", r"\1", value)
            pos = m.end()
        return cls(scheme.lower(), params)


class Authenticator:
    """Answers registry challenges for one repository."""

    def __init__(
        self,
        host: str,
        repository: str,
        creds: tuple[str, str] | None,
        session: requests.Session,
        insecure_remote: bool = False,
    ) -> None:
        self.host = host
        self.repository = repository
        self.creds = creds
        self.session = session
        self.insecure_remote = insecure_remote
        self.scheme = ""  # of the last challenge answered

    def _who(self) -> str:
        return f"user {self.creds[0]!r}" if self.creds else "anonymous access"

    def answer(self, header: str | None) -> str:
        """The Authorization header value that answers the challenge `header`."""
        if not header:
            raise SourceError(f"registry {self.host}: HTTP 401 without an auth challenge")
        challenge = Challenge.parse(header)
        self.scheme = challenge.scheme
        if challenge.scheme == "basic":
            if self.creds is None:
                raise SourceError(
                    f"registry {self.host} requires credentials: use --creds USER:PASS "
                    "or docker login"
                )
            raw = f"{self.creds[0]}:{self.creds[1]}".encode()
            return "Basic " + base64.b64encode(raw).decode()
        if challenge.scheme == "bearer":
            return "Bearer " + self._token(challenge.params)
        raise SourceError(f"registry {self.host}: unsupported auth scheme {challenge.scheme!r:.40}")

    def _token(self, params: dict[str, str]) -> str:
        realm = params.get("realm", "")
        url = urllib.parse.urlsplit(realm)
        if url.scheme not in ("http", "https") or not url.netloc:
            raise SourceError(f"registry {self.host}: invalid token realm {realm!r:.100}")
        if url.scheme == "http" and not is_loopback(url.netloc) and not self.insecure_remote:
            raise SourceError(
                f"registry {self.host}: refusing a plain-HTTP token service {url.netloc} "
                "(credentials would travel in clear)"
            )
        query = {"scope": params.get("scope") or f"repository:{self.repository}:pull"}
        if "service" in params:
            query["service"] = params["service"]
        try:
            resp = self.session.get(realm, params=query, auth=self.creds, timeout=TOKEN_TIMEOUT)
        except requests.RequestException as e:
            raise SourceError(f"registry {self.host}: token service {url.netloc}: {e}") from None
        if resp.status_code in (401, 403):
            raise SourceError(
                f"registry {self.host}: authentication failed: the token service refused "
                f"{self._who()} (HTTP {resp.status_code})"
            )
        if resp.status_code != 200:
            raise SourceError(
                f"registry {self.host}: token service {url.netloc} answered HTTP {resp.status_code}"
            )
        try:
            body = resp.json()
        except ValueError:
            body = None
        token = body.get("token") or body.get("access_token") if isinstance(body, dict) else None
        if not isinstance(token, str) or not token:
            raise SourceError(f"registry {self.host}: the token service returned no token")
        log.debug("registry %s: got a token for %s", self.host, query["scope"])
        return token
