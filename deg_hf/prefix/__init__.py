"""Shared-prefix preference forward: each prompt runs once per pair (see :mod:`.sharing`)."""
