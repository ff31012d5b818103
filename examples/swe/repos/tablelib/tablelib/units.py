"""Length conversion through metres."""

METRES = {
    "mm": 0.001,
    "cm": 0.01,
    "m": 1.0,
    "km": 1000.0,
    "in": 0.0254,
    "ft": 0.3048,
    "yd": 0.9144,
    "mi": 1609.344,
}


def convert(value: float, unit: str, to: str) -> float:
    """`value` in `unit` expressed in `to`; KeyError for an unknown unit."""
    return value * METRES[unit] / METRES[to]
