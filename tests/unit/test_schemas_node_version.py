"""A node's registration (``NodeSpec``) is a versioned wire message that is always read as
this release's version: an agent config written by an older release (or pinning a version)
registers what this release writes, and the same node compares equal whatever wrote it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sailor.schemas import SCHEMA_VERSION
from sailor.schemas.hardware import NodeSpec

NODE = {"node_id": "n1", "gpu_type": "A100-40", "gpus": 4, "zone": "z-a"}


def test_an_older_or_pinned_version_reads_as_this_releases() -> None:
    mine = NodeSpec.model_validate(NODE)
    assert mine.schema_version == SCHEMA_VERSION
    for v in range(1, SCHEMA_VERSION + 1):
        old = NodeSpec.model_validate(NODE | {"schema_version": v})
        assert old == mine
        assert f'"schema_version":{SCHEMA_VERSION}' in old.model_dump_json()


def test_unknown_fields_are_dropped_only_from_a_newer_version() -> None:
    newer = NodeSpec.model_validate(NODE | {"schema_version": SCHEMA_VERSION + 1, "nics": 8})
    assert newer == NodeSpec.model_validate(NODE)
    with pytest.raises(ValidationError, match="nics"):
        NodeSpec.model_validate(NODE | {"schema_version": SCHEMA_VERSION, "nics": 8})
    with pytest.raises(ValidationError, match="schema_version"):
        NodeSpec.model_validate(NODE | {"schema_version": 0})
