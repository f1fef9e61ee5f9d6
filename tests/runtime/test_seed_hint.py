"""The seed hint (tools/hint_command.py `record_seed`, SPEC.md 9.4): `weenv convert` and
`weenv compose` run the image's own command in a sandbox of the new environment and publish
what it read as the hint tagged `seed`, packed; mounts replay it while the environment has no
hint `latest`, and the first run, which records one, replays it too, so what it publishes
holds the seed's reads. Real sandboxes, mounts and a local store (the runtime fixtures)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from rt_support import EnvRef, compose_and_record
from support.runtime_fixtures import GROUP

from weenvfs.errors import RefNotFound
from weenvfs.format.manifest import RuntimeConfig
from weenvfs.format.refs import SEED_TAG
from weenvfs.fuse.commands import read_stats
from weenvfs.runtime import mounts
from weenvfs.runtime.environment import Environment
from weenvfs.runtime.recording import SWITCH_ENV, recording_key
from weenvfs.store import open_store
from weenvfs.store.repository import Repository
from weenvfs.tools.hint_command import SEED_SWITCH, record_seed

READ = "cat /usr/bin/dpkg /usr/bin/apt-get > /dev/null 2>&1; cat /etc/os-release > /dev/null"
SHELL = RuntimeConfig(cmd=("/bin/sh",))


def _tag(env: EnvRef, tag: str) -> str | None:
    with open_store(str(env.store)) as store:
        try:
            return Repository(store).get_tag("hints", env.digest, tag)
        except RefNotFound:
            return None


def _hint(env: EnvRef, digest: str):  # noqa: ANN202 - format.hints.Hint
    with open_store(str(env.store)) as store:
        return Repository(store).get_hint(digest)


def test_the_images_command_becomes_the_packed_seed(make_env: Callable[..., EnvRef]) -> None:
    env = make_env(SHELL)
    hint, line = record_seed(str(env.store), env.digest, env.cache)
    assert hint is not None and hint[:12] in line and "`/bin/sh`" in line, line
    assert _tag(env, SEED_TAG) == hint and _tag(env, "latest") is None
    seed = _hint(env, hint)
    assert seed.records and seed.pack is not None  # /bin/sh and its libraries, one blob
    again, line = record_seed(str(env.store), env.digest, env.cache)  # one seed is enough
    assert again is None and "has a hint seed already" in line


def test_a_command_that_never_ends_is_stopped_and_still_recorded(
        make_env: Callable[..., EnvRef]) -> None:
    env = make_env(RuntimeConfig(cmd=("/bin/sleep", "1000")))
    hint, line = record_seed(str(env.store), env.digest, env.cache, timeout=2)
    assert hint is not None and "stopped after 2 s" in line, line
    assert _hint(env, hint).records


def test_the_images_command_runs_bounded(make_env: Callable[..., EnvRef]) -> None:
    """Its writes stay in a small tmpfs (here: 1 GiB asked for, refused past 256 MiB: exit
    status 3, where 4 would say it was written), and it still leaves a seed."""
    env = make_env(RuntimeConfig(cmd=(
        "/bin/sh", "-c", "if head -c 1073741824 /dev/zero > /big; then exit 4; fi; exit 3")))
    hint, line = record_seed(str(env.store), env.digest, env.cache)
    assert hint is not None and "exit status 3" in line, line


def test_no_command_or_a_hint_of_its_own_means_no_seed(make_env: Callable[..., EnvRef]) -> None:
    bare = make_env(RuntimeConfig())
    assert record_seed(str(bare.store), bare.digest, bare.cache) == (
        None, "no seed hint: the image has no entrypoint or cmd")
    hinted = make_env(SHELL)
    with open_store(str(hinted.store)) as store:
        repo = Repository(store)
        repo.set_tag("hints", hinted.digest, "latest", repo.put_object("hints", b"x"))
    hint, line = record_seed(str(hinted.store), hinted.digest, hinted.cache)
    assert hint is None and "has a hint latest already" in line
    assert _tag(hinted, SEED_TAG) is None


def test_the_first_run_replays_the_seed_and_publishes_a_hint_that_holds_it(
        make_env: Callable[..., EnvRef], monkeypatch: pytest.MonkeyPatch) -> None:
    env = make_env(SHELL)
    seed, _ = record_seed(str(env.store), env.digest, env.cache)
    assert seed is not None
    # A mount that does not record replays the seed while there is no hint `latest`.
    with Environment.open(env.ref, store=env.store, cache=env.cache, record_hint=False) as box:
        doc = read_stats(env.mountpoint())
        assert doc["hints"]["hint"] == seed, doc["hints"]
        assert box.exec(["/bin/sh", "-c", READ]).ok
    monkeypatch.delenv(SWITCH_ENV, raising=False)  # the first run records (the default)
    with Environment.open(env.ref, store=env.store, cache=env.cache) as box:
        assert box.exec(["/bin/sh", "-c", READ]).ok
    outcome = box.hint_outcome
    assert outcome is not None and outcome["hint"] == _tag(env, "latest")
    recorded = {(r.group, r.chunk) for r in _hint(env, outcome["hint"]).records}
    assert {(r.group, r.chunk) for r in _hint(env, seed).records} <= recorded
    assert _tag(env, SEED_TAG) == seed  # kept: only replayed while there is no `latest`


def test_compose_records_the_seed_by_default(
        minbase_store: Path, tmp_path: Path, test_digests: set[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    for switch in (SEED_SWITCH, SWITCH_ENV):  # both on, as on a node by default
        monkeypatch.delenv(switch, raising=False)
    # A label of its own: the same groups and config make the same manifest, seed included.
    digest, stderr = compose_and_record(minbase_store, f"seeded-{tmp_path.name}:t", GROUP,
                                        tmp_path / "cache", test_digests, "--cmd", '["/bin/sh"]',
                                        "--label", f"test={tmp_path.name}")
    assert "seed hint" in stderr and "recorded from the image's command" in stderr
    with open_store(str(minbase_store)) as store:
        Repository(store).get_tag("hints", digest, SEED_TAG)  # exists
    skipped = subprocess.run(
        [sys.executable, "-m", "weenvfs", "compose", f"unseeded-{tmp_path.name}:t", "--group",
         GROUP, "--cmd", '["/bin/sh"]', "--store", str(minbase_store), "--no-seed-hint"],
        capture_output=True, timeout=300, check=True)
    assert b"seed" not in skipped.stderr
    assert json.loads(subprocess.run(  # --json: no seed tried is null
        [sys.executable, "-m", "weenvfs", "compose", f"unseeded-{tmp_path.name}:j", "--group",
         GROUP, "--cmd", '["/bin/sh"]', "--store", str(minbase_store), "--no-seed-hint",
         "--json"], capture_output=True, timeout=300, check=True).stdout)["seed_hint"] is None


def test_the_json_result_says_what_the_seed_did(
        minbase_store: Path, tmp_path: Path, test_digests: set[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    for switch in (SEED_SWITCH, SWITCH_ENV):
        monkeypatch.delenv(switch, raising=False)
    cache = tmp_path / "cache"
    done = subprocess.run(
        [sys.executable, "-m", "weenvfs", "compose", f"seeded-{tmp_path.name}:j", "--group",
         GROUP, "--cmd", '["/bin/sh"]', "--label", f"test={tmp_path.name}", "--store",
         str(minbase_store), "--hint-cache", str(cache), "--json"],
        capture_output=True, timeout=300, check=False)
    result = json.loads(done.stdout)  # stdout is the JSON alone
    with open_store(str(minbase_store)) as store:
        test_digests.update({result["manifest"],
                             recording_key(result["manifest"], store.url, cache, SEED_TAG)})
        seed = Repository(store).get_tag("hints", result["manifest"], SEED_TAG)
    assert done.returncode == 0, done.stderr
    assert result["seed_hint"]["hint"] == seed and seed[:12] in result["seed_hint"]["said"]


def test_mounts_and_the_recording_mount_agree_on_the_seed_tag() -> None:
    assert mounts.RECORD_REPLAY == SEED_TAG


def test_a_store_that_fails_is_one_line_not_an_error(tmp_path: Path) -> None:
    """The environment is published already: a seed that cannot be recorded says why."""
    hint, line = record_seed(str(tmp_path / "no-store"), "ab" * 32, None)
    assert hint is None and line.startswith("no seed hint: ") and "\n" not in line


def test_a_recording_publishes_the_tag_it_is_given(env_ref: EnvRef) -> None:
    """`weenv run --record-tag` (how the seed is recorded): carried to the recording mount,
    which is one of its own, and through the node service's resolution; a bad tag is refused."""
    from weenvfs.errors import UsageError
    from weenvfs.runtime.environment import resolve_source
    from weenvfs.runtime.node_resolve import source_from_json, source_to_json

    source = resolve_source(env_ref.ref, env_ref.store, env_ref.cache, True, record_tag=SEED_TAG)
    assert source.record_tag == SEED_TAG
    assert source_from_json(source_to_json(source)) == source
    url = source.store_url
    assert recording_key(env_ref.digest, url, env_ref.cache) == recording_key(
        env_ref.digest, url, env_ref.cache, "latest")
    assert recording_key(env_ref.digest, url, env_ref.cache, SEED_TAG) != recording_key(
        env_ref.digest, url, env_ref.cache)
    assert resolve_source(env_ref.ref, env_ref.store, env_ref.cache, False).record_tag is None
    with pytest.raises(UsageError, match="--record-tag"):
        resolve_source(env_ref.ref, env_ref.store, env_ref.cache, True, record_tag="a/b")
