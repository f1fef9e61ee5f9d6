"""Fixtures for the escape attempts: the runtime fixtures (tests/support/runtime_fixtures.py)
plus `probe`, a static C program (probe.c, built with `gcc -static` once per session) that
makes one syscall per verb inside a sandbox, and `hostile_env(*entries, config=None)`, an
environment of the minbase group with a task group on top holding `entries` (tests/support
trees specs) and the probe at /usr/local/bin/probe.
"""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from support import layers
from support.runtime import EnvRef
from support.runtime_fixtures import (  # noqa: F401  (pytest finds fixtures by name here)
    GROUP,
    _runtime_requirements,
    env_ref,
    make_env,
    minbase_store,
    no_default_hint_recording,
    node_clean,
    test_digests,
)
from support.trees import Spec, file

from weenvfs.format.manifest import RuntimeConfig
from weenvfs.store import open_store
from weenvfs.store.repository import Repository
from weenvfs.tools.builder import build_group, open_source

PROBE = "/usr/local/bin/probe"



@pytest.fixture(scope="session")
def probe(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The bytes of the static probe binary."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc not found (Debian package gcc)")
    out = tmp_path_factory.mktemp("probe") / "probe"
    subprocess.run(["gcc", "-static", "-O1", "-o", str(out), str(Path(__file__).with_name(
        "probe.c"))], check=True, capture_output=True)
    return out.read_bytes()


@pytest.fixture
def hostile_env(make_env: Callable[..., EnvRef], minbase_store: Path, tmp_path: Path,  # noqa: F811
                probe: bytes) -> Callable[..., EnvRef]:
    """`hostile_env(*entries, config=None)`: a new environment whose top group holds
    `entries` and the probe."""
    count = [0]

    def build(*entries: Spec, config: RuntimeConfig | None = None) -> EnvRef:
        count[0] += 1
        tar = layers.layer_file(tmp_path / f"hostile{count[0]}.tar", *entries,
                                file(PROBE.lstrip("/"), probe, mode=0o755))
        group = f"hostile{count[0]}-{uuid.uuid4().hex[:8]}"
        with open_store(str(minbase_store)) as opened:
            build_group(open_source(tar), Repository(opened), group, "t")
        return make_env(config, name=group, groups=[GROUP, f"{group}:t"])

    return build
