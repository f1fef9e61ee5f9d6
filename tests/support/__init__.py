"""Test support: declarative trees (trees.py), OCI layer tarballs (layers.py) and an
independent reference applier of OCI layers (oci_apply.py). Test-only; never imported by
the weenvfs package."""
