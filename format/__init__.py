"""THE FORMAT: WeEnv's pure codec (stdlib + zstandard + blake3, no I/O).

`SPEC.md` beside this file is normative; the modules mirror it:
`constants` (byte tables as `struct.Struct`), `digest` (BLAKE3 ids), `chunk` (zstd frames),
`index` (the binary group index, used in place), `canonical_json` (the one spelling of a JSON
value), `manifest` (environment manifests),
`hints` (prefetch hints), `refs` (store keys, names and tags).
"""

from __future__ import annotations
