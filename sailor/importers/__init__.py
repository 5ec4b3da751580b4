"""Converters from other tools' file formats into Sailor's schemas."""
