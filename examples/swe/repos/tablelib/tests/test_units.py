"""One test per (unit, target, value) row: 8 x 8 units x 4 values = 256 tests."""

from tablelib.units import METRES, convert

VALUES = [0.0, 1.0, 2.5, 1000.0]


def _case(unit, to, value):
    def test():
        expected = value * METRES[unit] / METRES[to]
        assert abs(convert(value, unit, to) - expected) <= 1e-9 * max(1.0, abs(expected))

    return test


for _unit in sorted(METRES):
    for _to in sorted(METRES):
        for _index, _value in enumerate(VALUES):
            globals()[f"test_convert_{_unit}_to_{_to}_{_index}"] = _case(_unit, _to, _value)


def test_metre_is_one():
    assert convert(1.0, "m", "m") == 1.0


def test_mile_in_feet():
    assert abs(convert(1.0, "mi", "ft") - 5280.0) < 1e-9
