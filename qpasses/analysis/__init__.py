"""Typed analyses shared by passes, cached per model generation (``QModel.cached``).

Passes import analyses, never each other: what two passes share lives here."""
