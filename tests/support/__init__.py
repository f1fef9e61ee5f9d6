"""Test support: declarative trees (trees.py), OCI layer tarballs (layers.py), an
independent reference applier of OCI layers (oci_apply.py) and a mount server of one test
(mount_server.py). Test-only; never imported by
the weenvfs package."""
