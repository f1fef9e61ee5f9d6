"""The runtime test helpers, now in tests/support/runtime.py (shared with tests/security)."""

from support.runtime import (  # noqa: F401  (re-exported for the runtime tests)
    CLI_TIMEOUT,
    CONTROLLER,
    EnvRef,
    NodeSnapshot,
    compose_and_record,
    controller,
    force_cleanup,
    gc_over_an_orphan,
    leaks,
    loop_devices,
    owned_by,
    pid_visible,
    run_weenv,
    runtime_unavailable,
    sample_store,
    started_run,
)
