"""Fixtures of the format tests: the golden vectors as files, as parsed JSON, and decoded.

Owns: putting this folder on sys.path (for `format_support`), the `vectors_doc`, `vector_files`
and `generator` fixtures. Must not: build trees of its own (tests do that).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from format_support import VECTORS_DIR, load_generator  # noqa: E402


@pytest.fixture(scope="session")
def vectors_doc() -> dict[str, Any]:
    """vectors.json, parsed."""
    return json.loads((VECTORS_DIR / "vectors.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def vector_files() -> dict[str, bytes]:
    """Every generated file of format/vectors/ by name."""
    return {
        p.name: p.read_bytes()
        for p in VECTORS_DIR.iterdir()
        if p.is_file() and p.suffix in (".bin", ".zst", ".blob", ".json", ".img")
    }


@pytest.fixture(scope="session")
def generator() -> ModuleType:
    """format/vectors/generate.py, imported by path."""
    return load_generator()
