"""Which Sailor release this node's workers run: the package's version and a digest of its
code.

The workers of one job must run one release: every rank computes the same collectives of a
step and the same checkpoint writers without talking, in its own copy of the code. The
version alone does not tell two builds of one version apart (a patched install, a checkout),
so the release is the version plus the first 12 hex digits of a SHA-256 over the package's
code and data files (``.py``, the catalog's ``.json``, ``.yaml``: their paths and bytes, in
path order; not bytecode caches or stray files of an install). Computed once per process:
a few hundred files, tens of ms.
"""

from __future__ import annotations

import functools
import hashlib
from importlib import metadata
from pathlib import Path

__all__ = ["code_digest", "sailor_release"]

_PACKAGE = Path(__file__).resolve().parents[1]

_CODE_AND_DATA = (".py", ".json", ".yaml", ".yml")
"""What the digest reads: the code and the package data the workers' choices read (the
catalog), not whatever else lies in an install (an editor's swap file, a build artefact)."""


def code_digest(root: Path) -> str:
    """SHA-256 (hex) over the code and data files under ``root`` (:data:`_CODE_AND_DATA`,
    bytecode caches left out): each one's path relative to ``root`` and its bytes, in path
    order."""
    h = hashlib.sha256()
    files = (
        f
        for f in root.rglob("*")
        if f.suffix in _CODE_AND_DATA and "__pycache__" not in f.parts and f.is_file()
    )
    for f in sorted(files):
        rel = f.relative_to(root).as_posix()
        h.update(rel.encode() + b"\0")
        h.update(f.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


@functools.cache
def sailor_release() -> str:
    """``<version>+<12 hex digits of the code digest>`` of the installed package."""
    try:
        version = metadata.version("sailor")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return f"{version}+{code_digest(_PACKAGE)[:12]}"
