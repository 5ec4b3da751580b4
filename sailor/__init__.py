"""Sailor: plan and run training on heterogeneous, geo-distributed, dynamic GPU clusters."""

__version__ = "0.1.0"
