"""Analyses shared by passes; those worth caching are typed keys (``qpasses.ir.analyses``).

Passes import analyses, never each other: what two passes share lives here."""
