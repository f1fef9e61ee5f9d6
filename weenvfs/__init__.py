"""WeEnv: lazily loaded, content-addressed environments for agentic RL rollouts.

The single import name of the project. `weenvfs.format` (the codec, from `format/`) and
`weenvfs.tools` (the build side, from `tools/`) are installed under it by `pyproject.toml`;
the node side (store, core, fuse, runtime, provision, cli) lives in this folder. This module
only carries the version: importing it must stay cheap and must not pull in any subpackage.
"""

from __future__ import annotations

__version__ = "0.1.0"
