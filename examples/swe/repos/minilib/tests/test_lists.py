from minilib.lists import chunk, dedupe, flatten, rotate, windows


def test_chunk():
    assert chunk([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]


def test_chunk_exact():
    assert chunk([1, 2, 3, 4], 2) == [[1, 2], [3, 4]]


def test_flatten():
    assert flatten([[1, 2], [], [3]]) == [1, 2, 3]


def test_dedupe_keeps_first_order():
    assert dedupe([3, 1, 3, 2, 1]) == [3, 1, 2]


def test_rotate_left():
    assert rotate([1, 2, 3, 4], 1) == [2, 3, 4, 1]


def test_rotate_more_than_length():
    assert rotate([1, 2, 3], 4) == [2, 3, 1]


def test_rotate_right():
    assert rotate([1, 2, 3, 4], -1) == [4, 1, 2, 3]


def test_windows():
    assert windows([1, 2, 3, 4], 3) == [[1, 2, 3], [2, 3, 4]]


def test_windows_whole():
    assert windows([1, 2], 2) == [[1, 2]]
