"""The registry fixture, now in tests/support/registry.py (shared with tests/snapshotter)."""

from support.registry import (  # noqa: F401  (re-exported for the conversion tests)
    AuthProxy,
    Registry,
    free_port,
    run_auth_proxy,
    run_registry,
    tools_missing,
)
