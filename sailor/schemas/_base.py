"""Base classes shared by every schema: frozen, strict, described.

Every model forbids unknown fields and is immutable, so a value handed to the pure core
(simulator, planner, the controller's decision function) cannot be changed under it.
Wire messages (events, commands, manifests) additionally carry a schema version.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["SCHEMA_VERSION", "Frozen", "WireMessage", "field_error"]

SCHEMA_VERSION = 1
"""Version of the wire format. A reader accepts messages whose version it knows."""


class Frozen(BaseModel):
    """Immutable, strict base model."""

    # allow_inf_nan=False: JSON has no infinity or NaN (pydantic writes them as null, which
    # no reader accepts back), and no schema field means either.
    model_config = ConfigDict(
        frozen=True, extra="forbid", validate_default=True, allow_inf_nan=False
    )


class WireMessage(Frozen):
    """A message that crosses a process boundary (NATS, etcd, files)."""

    schema_version: int = Field(
        default=SCHEMA_VERSION,
        description="Version of the wire schema this message was written with.",
    )

    def model_post_init(self, context: Any, /) -> None:
        if self.schema_version > SCHEMA_VERSION or self.schema_version < 1:
            raise ValueError(
                f"schema_version={self.schema_version} is not supported "
                f"(this build reads versions 1..{SCHEMA_VERSION})"
            )


def field_error(field: str, value: object, why: str) -> ValueError:
    """A ValueError that names the offending field and value."""
    return ValueError(f"{field}={value!r}: {why}")
