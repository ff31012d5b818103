"""Number helpers."""


def clamp(value: float, low: float, high: float) -> float:
    """`value` limited to [low, high]."""
    if low > high:
        raise ValueError("low must not exceed high")
    return max(low, min(value, high))


def mean(values: list[float]) -> float:
    """Arithmetic mean; ValueError for no values."""
    if not values:
        raise ValueError("mean of no values")
    return sum(values) / len(values)


def median(values: list[float]) -> float:
    """Middle value (mean of the two middle ones for an even count); ValueError for none."""
    if not values:
        raise ValueError("median of no values")
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2 == 1:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


def gcd(a: int, b: int) -> int:
    """Greatest common divisor, always >= 0."""
    a, b = abs(a), abs(b)
    while b:
        a, b = b, a % b
    return a


def is_prime(n: int) -> bool:
    """True for 2, 3, 5, 7, ..."""
    if n < 2:
        return False
    divisor = 2
    while divisor * divisor <= n:
        if n % divisor == 0:
            return False
        divisor += 1
    return True


def fibonacci(n: int) -> int:
    """The n-th Fibonacci number: fibonacci(0) == 0, fibonacci(1) == 1."""
    if n < 0:
        raise ValueError("n must be >= 0")
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
