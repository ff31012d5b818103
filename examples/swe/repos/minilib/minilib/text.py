"""Text helpers."""

SMALL_WORDS = {"a", "an", "and", "of", "the", "in", "on"}


def slugify(text: str) -> str:
    """Lower-case words joined by single dashes: 'Hello, World!' -> 'hello-world'."""
    out: list[str] = []
    for char in text.lower():
        if char.isalnum():
            out.append(char)
        elif out and out[-1] != "-":
            out.append("-")
    return "".join(out).strip("-")


def title_case(text: str) -> str:
    """Capitalise each word but the small ones ('of', 'the', ...), except the first word."""
    words = text.split()
    titled = []
    for index, word in enumerate(words):
        if index > 0 and word.lower() in SMALL_WORDS:
            titled.append(word.lower())
        else:
            titled.append(word[:1].upper() + word[1:].lower())
    return " ".join(titled)


def truncate(text: str, width: int, suffix: str = "...") -> str:
    """`text` cut to at most `width` characters, ending in `suffix` when cut."""
    if len(text) <= width:
        return text
    return text[: width - len(suffix)] + suffix


def count_words(text: str) -> int:
    """Words separated by any whitespace."""
    return len(text.split())


def is_palindrome(text: str) -> bool:
    """Reads the same both ways, ignoring case and anything but letters and digits."""
    letters = [char.lower() for char in text if char.isalnum()]
    return letters == letters[::-1]
