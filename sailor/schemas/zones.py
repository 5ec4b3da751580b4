"""A zone's region, for the clouds' zone names.

Two zones of one region share the region's network and prices (cheaper egress, faster
links than across regions), so the region must come out right for every cloud:

- Google Cloud: ``us-central1-a`` → ``us-central1`` (all but the last ``-`` part);
- AWS: ``us-east-1a`` → ``us-east-1`` (the zone letter is glued to the region), local and
  wavelength zones ``us-west-2-lax-1a`` → ``us-west-2``;
- any other name: all but its last ``-`` part (``z-a-1`` → ``z-a``, ``z-b`` → ``z``), or
  the name itself without a ``-`` (``local``, ``eastus``).

Pure.
"""

from __future__ import annotations

import re

__all__ = ["region_of"]

_AWS = re.compile(r"^([a-z]{2}(?:-gov|-iso[a-z]*)?-[a-z]+-\d+)(?:-[a-z]+-\d+)?[a-z]$")
"""An AWS availability zone (``us-east-1a``, ``us-gov-west-1b``, ``us-west-2-lax-1a``)."""


def region_of(zone: str) -> str:
    """The region ``zone`` belongs to (see the module's rules)."""
    m = _AWS.match(zone)
    if m is not None:
        return m.group(1)
    return zone.rsplit("-", 1)[0]
