from minilib.dates import day_of_year, days_in_month, is_leap


def test_is_leap():
    assert is_leap(2024)
    assert not is_leap(2023)


def test_is_leap_centuries():
    assert not is_leap(1900)
    assert is_leap(2000)


def test_days_in_month():
    assert days_in_month(2023, 1) == 31
    assert days_in_month(2023, 4) == 30


def test_days_in_february():
    assert days_in_month(2023, 2) == 28
    assert days_in_month(2024, 2) == 29


def test_day_of_year():
    assert day_of_year(2023, 1, 1) == 1
    assert day_of_year(2023, 3, 1) == 60


def test_day_of_year_leap():
    assert day_of_year(2024, 3, 1) == 61
    assert day_of_year(2024, 12, 31) == 366
