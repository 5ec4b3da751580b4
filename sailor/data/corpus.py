"""Where ``sailor data prepare`` reads documents: text files, JSON lines, built-in corpora.

Built-in corpora are text the Python installation itself ships, so a demo or a test can
prepare real text offline on any machine with nothing downloaded:

* ``python-docs`` — the Python Language Reference topics that ``help()`` shows
  (``pydoc_data.topics``; English prose with grammar snippets, one document per topic;
  about 0.46 MB on CPython 3.11). Loads instantly.
* ``python-stdlib`` — the source of the standard library's top-level modules
  (``Lib/*.py``: code, docstrings and comments, one document per module; about 4.7 MB on
  CPython 3.11). Reading them is a directory listing and file reads, no parsing.

Both exist on every CPython installation that ships its standard library sources (all but
"embeddable" builds that carry only bytecode). Their text changes between Python versions,
which is why the manifest records the version it was read from.

Must never tokenize or write: it only yields ``(name, text)`` documents.
"""

from __future__ import annotations

import json
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "BUILTIN_CORPORA",
    "builtin_corpus",
    "jsonl_documents",
    "python_version",
    "text_documents",
]

BUILTIN_CORPORA = {
    "python-docs": "Python Language Reference topics shipped in pydoc_data.topics (help())",
    "python-stdlib": "source of the standard library's top-level modules (Lib/*.py)",
}


def text_documents(paths: list[Path]) -> Iterator[tuple[str, str]]:
    """One document per text file (UTF-8; undecodable bytes replaced)."""
    for p in paths:
        yield str(p), p.read_text(encoding="utf-8", errors="replace")


def jsonl_documents(paths: list[Path], field: str) -> Iterator[tuple[str, str]]:
    """One document per JSON line, its text in ``field``; a bad line is refused by name."""
    for p in paths:
        with p.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{p}:{lineno}: not JSON: {exc}") from exc
                except RecursionError as exc:  # json's own limit, not a JSONDecodeError
                    raise ValueError(f"{p}:{lineno}: not JSON: nested too deep") from exc
                if not isinstance(obj, dict) or field not in obj:
                    keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
                    raise ValueError(f"{p}:{lineno}: no field {field!r} (has {keys})")
                text = obj[field]
                if not isinstance(text, str):
                    raise ValueError(
                        f"{p}:{lineno}: field {field!r} is {type(text).__name__}, not text"
                    )
                yield f"{p}:{lineno}", text


def builtin_corpus(name: str) -> Iterator[tuple[str, str]]:
    """Documents of a built-in corpus (:data:`BUILTIN_CORPORA`), in a fixed order."""
    if name == "python-docs":
        from pydoc_data.topics import topics

        for topic in sorted(topics):
            yield f"pydoc_data.topics[{topic!r}]", topics[topic]
    elif name == "python-stdlib":
        lib = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(lib.glob("*.py"))
        if not files:
            raise FileNotFoundError(
                f"{lib}: no standard library sources (*.py) in this Python installation"
            )
        yield from text_documents(files)
    else:
        raise ValueError(f"builtin corpus {name!r} is unknown; known: {', '.join(BUILTIN_CORPORA)}")


def python_version() -> str:
    """The running interpreter's version (recorded with a built-in corpus)."""
    v = sys.version_info
    return f"{sys.implementation.name} {v.major}.{v.minor}.{v.micro}"
