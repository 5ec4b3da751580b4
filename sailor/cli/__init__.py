"""The ``sailor`` command: the one entry point for users."""
