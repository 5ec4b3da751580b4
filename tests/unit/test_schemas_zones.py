"""Regions of the clouds' zone names (``sailor.schemas.zones``)."""

from __future__ import annotations

import pytest

from sailor.schemas.hardware import Zone
from sailor.schemas.prices import PriceTable
from sailor.schemas.zones import region_of


@pytest.mark.parametrize(
    ("zone", "region"),
    [
        ("us-central1-a", "us-central1"),  # Google Cloud
        ("europe-west4-b", "europe-west4"),
        ("us-east-1a", "us-east-1"),  # AWS: the letter is glued on
        ("ap-southeast-2c", "ap-southeast-2"),
        ("us-gov-west-1b", "us-gov-west-1"),
        ("us-west-2-lax-1a", "us-west-2"),  # an AWS local zone
        ("z-a-1", "z-a"),
        ("z-b", "z"),
        ("local", "local"),
        ("eastus", "eastus"),
    ],
)
def test_region_of_each_clouds_zone_names(zone: str, region: str) -> None:
    assert region_of(zone) == region
    assert Zone.parse(zone).region == region


def test_aws_zones_of_one_region_share_its_network_and_prices() -> None:
    """us-east-1a and us-east-1b are one region (us-east-1), us-east-2a another: before, all
    three were read as region ``us-east``."""
    prices = PriceTable()  # no egress table: the region defaults decide
    assert prices.egress_per_gb("us-east-1a", "us-east-1b") == prices.same_region_usd_per_gb
    assert prices.egress_per_gb("us-east-1a", "us-east-2a") == prices.cross_region_usd_per_gb
