from minilib.text import count_words, is_palindrome, slugify, title_case, truncate


def test_slugify_joins_words_with_single_dashes():
    assert slugify("Hello, World!") == "hello-world"


def test_slugify_keeps_digits():
    assert slugify("Top 10 tips") == "top-10-tips"


def test_slugify_strips_edges():
    assert slugify("  --Already slugged--  ") == "already-slugged"


def test_title_case_capitalises_words():
    assert title_case("the lord of the rings") == "The Lord of the Rings"


def test_title_case_lowers_the_rest_of_a_word():
    assert title_case("hELLO wORLD") == "Hello World"


def test_truncate_leaves_short_text():
    assert truncate("short", 10) == "short"


def test_truncate_cuts_to_width():
    assert truncate("a long sentence here", 10) == "a long ..."
    assert len(truncate("a long sentence here", 10)) == 10


def test_truncate_exact_width_is_not_cut():
    assert truncate("abcde", 5) == "abcde"


def test_count_words():
    assert count_words("one two\tthree\nfour") == 4


def test_count_words_empty():
    assert count_words("   ") == 0


def test_is_palindrome_ignores_case_and_punctuation():
    assert is_palindrome("A man, a plan, a canal: Panama")


def test_is_palindrome_false():
    assert not is_palindrome("palindrome")
