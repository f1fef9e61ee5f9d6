"""Fixtures for the runtime tests: real mounts, real overlayfs, real runc and cgroups (defined in
tests/support/runtime_fixtures.py, shared with tests/security).

- `minbase_store` (session): the cached Debian minbase sample (tools/sample.py) built once with
  the real builder into a LocalStore under the session's tmp folder, as group `minbase:t`;
- `make_env(config=None)`: composes a new environment of that group with a unique provenance,
  so every test gets its own manifest digest; its shared mounts are its own too (they are
  keyed by the test's chunk cache, whatever else runs on the node); returns an `EnvRef`
  (ref, store, digest, cache, mount keys);
- `env_ref`: one such environment;
- `warm_root`: shared mounts in a folder of the test's own, kept warm as on a node;
- `parked_env`: an environment whose runs park their roots, run by a node service of the
  test's own (test_parking.py, test_standby.py);
- autouse `node_clean`: snapshots what sandboxes leave on the node before the test; after it,
  fails the test if anything new of the test's environments is left (mounts, cgroups, runc
  containers, processes, upper dirs, env folders), or anything of a sandbox without state,
  and removes it (real teardown). Sandboxes of other jobs on the node are ignored.

Every test here needs root, runc, catatonit and FUSE: without them it skips with the reason
(or fails, with WEENVFS_TEST_STRICT=1 / WEENVFS_TEST_FUSE=1).

The tests here mount their environments' shared group mounts as a run with a hint does:
$WEENV_RECORD_HINTS=off turns the first-run recording off (test_hints_default.py turns it on).
"""

from __future__ import annotations

from support.namespaces import holders  # noqa: F401
from support.runtime_fixtures import (  # noqa: F401  (pytest finds fixtures by name here)
    GROUP,
    _runtime_requirements,
    env_ref,
    make_env,
    minbase_store,
    no_default_hint_recording,
    node_clean,
    parked_env,
    test_digests,
    warm_root,
)

