from minilib.numbers import clamp, fibonacci, gcd, is_prime, mean, median


def test_clamp_inside():
    assert clamp(5, 0, 10) == 5


def test_clamp_below_and_above():
    assert clamp(-3, 0, 10) == 0
    assert clamp(42, 0, 10) == 10


def test_clamp_refuses_an_empty_range():
    try:
        clamp(1, 5, 0)
    except ValueError:
        return
    raise AssertionError("clamp(1, 5, 0) should raise ValueError")


def test_mean():
    assert mean([1, 2, 3, 4]) == 2.5


def test_mean_of_nothing_raises():
    try:
        mean([])
    except ValueError:
        return
    raise AssertionError("mean([]) should raise ValueError")


def test_median_odd():
    assert median([3, 1, 2]) == 2


def test_median_even():
    assert median([4, 1, 3, 2]) == 2.5


def test_gcd():
    assert gcd(12, 18) == 6
    assert gcd(7, 13) == 1


def test_gcd_negative():
    assert gcd(-12, 18) == 6


def test_is_prime_small():
    assert [n for n in range(20) if is_prime(n)] == [2, 3, 5, 7, 11, 13, 17, 19]


def test_is_prime_square_of_prime():
    assert not is_prime(49)
    assert not is_prime(121)


def test_fibonacci():
    assert [fibonacci(n) for n in range(8)] == [0, 1, 1, 2, 3, 5, 8, 13]
