"""`qpasses passes`: every registered pass, its options with their defaults, and its facts."""
from __future__ import annotations

from ..core.pipeline import format_value, in_pipeline_order, option_default


def cmd_passes(args) -> int:
    for cls in in_pipeline_order():  # default pipeline order, then the rest by name
        print(f"{cls.name}: {cls.summary()}")
        for f in cls.options():
            print(f"    {f.name} = {format_value(option_default(f))}  {f.metadata.get('help', '')}".rstrip())
        if cls.requires:
            print(f"    requires: {', '.join(sorted(cls.requires))}")
        if cls.establishes:
            print(f"    establishes: {', '.join(sorted(cls.establishes))}")
        if cls.preserves:
            print(f"    preserves: {', '.join(sorted(cls.preserves))}")
    return 0
