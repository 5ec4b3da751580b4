"""A zone's region, for the clouds' zone names.

Two zones of one region share the region's network and prices (cheaper egress, faster
links than across regions), so the region must come out right for every cloud:

- Google Cloud: ``us-central1-a`` → ``us-central1`` (all but the last ``-`` part);
- AWS: ``us-east-1a`` → ``us-east-1`` (the zone letter is glued to the region); local
  zones ``us-west-2-lax-1a`` and wavelength zones ``us-east-1-wl1-bos-wlz-1`` → their parent
  region (its prices), but they are *edge* zones (:func:`edge_zone`): another metro, not on
  the region's fabric;
- any other name: all but its last ``-`` part (``z-a-1`` → ``z-a``, ``z-b`` → ``z``), or
  the name itself without a ``-`` (``local``, ``eastus``).

Pure.
"""

from __future__ import annotations

import re

__all__ = ["edge_zone", "region_of"]

_AWS = re.compile(r"^([a-z]{2}(?:-gov|-iso[a-z]*)?-[a-z]+-\d+)(-[a-z]+-\d+)?[a-z]$")
"""An AWS availability zone (``us-east-1a``, ``us-gov-west-1b``) or local zone
(``us-west-2-lax-1a``, group 2)."""

_AWS_WAVELENGTH = re.compile(r"^([a-z]{2}-[a-z]+-\d+)-wl\d+-[a-z]+-wlz-\d+$")
"""An AWS wavelength zone (``us-east-1-wl1-bos-wlz-1``)."""


def edge_zone(zone: str) -> bool:
    """Whether ``zone`` is an AWS local or wavelength zone (``us-west-2-lax-1a``): in its
    parent region for prices, but in another metro, reached over the provider's backbone,
    not on the region's own fabric as its availability zones are."""
    m = _AWS.match(zone)
    return (m is not None and m.group(2) is not None) or _AWS_WAVELENGTH.match(zone) is not None


def region_of(zone: str) -> str:
    """The region ``zone`` belongs to (see the module's rules)."""
    m = _AWS.match(zone) or _AWS_WAVELENGTH.match(zone)
    if m is not None:
        return m.group(1)
    return zone.rsplit("-", 1)[0]
