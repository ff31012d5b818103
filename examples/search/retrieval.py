"""Local BM25 search over a Search-R1-style corpus (JSONL of {"id", "contents"}, title on the
first line of `contents`), with `bm25s`.

Invariants:
- The index is built once per corpus content, into `<cache>/<key>/` (cache: env
  `REINS_SEARCH_CACHE`, default `~/.cache/reins/search`; key: the sha256 of the index format and
  the corpus's bytes, or for files over 256 MB of its path, size and mtime, so a 13 GB wiki dump
  is not hashed by every agent).
- Building is atomic and happens once: under an exclusive `flock` on `<key>.lock`, a process that
  finds no index builds it in a temporary folder beside it and renames that into place. Agents
  starting together wait on the lock, then load what the first one built; a crash mid-build leaves
  only a temporary folder (`.<key>-xxxx`), never a half index, and the next build (of any corpus)
  removes it: a temporary folder is written only under its key's lock, so one whose lock is free
  has no writer left.
- Every process loads the index memory-mapped (`bm25s` `mmap=True`) and reads passages by byte
  offset from the corpus file (offsets kept in the index folder): nothing is rebuilt per rollout,
  and nothing is written beside the user's corpus.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_CORPUS = Path(__file__).parent / "corpus.jsonl"
_HASH_LIMIT = 256 * 2**20
_DONE = "complete.json"  # written last inside the temporary folder: a finished index has it
_FORMAT = "bm25s-en-stopwords-1"  # part of the key: a tokenizer change must not reuse old indexes


def cache_root() -> Path:
    return Path(os.environ.get("REINS_SEARCH_CACHE") or Path.home() / ".cache/reins/search")


def corpus_key(corpus: Path) -> str:
    """The cache key of `corpus`: its content's sha256 (by path, size and mtime when huge)."""
    stat = corpus.stat()
    digest = hashlib.sha256(_FORMAT.encode() + b"\n")
    if stat.st_size <= _HASH_LIMIT:
        with corpus.open("rb") as f:
            for block in iter(lambda: f.read(2**20), b""):
                digest.update(block)
    else:
        digest.update(f"{corpus.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:32]


def _tokenize(texts: list[str]) -> list[list[str]]:
    import bm25s

    tokens = bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)
    return tokens  # type: ignore[return-value]


class CorpusError(ValueError):
    """A corpus file that is not one passage object a line with its text in `contents`."""


def _contents(corpus: Path, number: int, line: bytes) -> str:
    try:
        passage = json.loads(line)
    except ValueError as error:
        raise CorpusError(f"{corpus}:{number}: not JSON in UTF-8 ({error})") from None
    text = passage.get("contents") if isinstance(passage, dict) else None
    if not isinstance(text, str):
        raise CorpusError(
            f"{corpus}:{number}: a passage is an object with its text in `contents` (Search-R1's "
            f"corpus layout), not {line[:80]!r}"
        )
    return text


def check_corpus(corpus: Path) -> None:
    """A `CorpusError` (or OSError) unless `corpus` is a file whose first passage reads."""
    with corpus.open("rb") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                _contents(corpus, number, line)
                return
    raise CorpusError(f"{corpus} holds no passages")


def _build(corpus: Path, folder: Path) -> None:
    import bm25s
    import numpy as np

    offsets: list[int] = []
    texts: list[str] = []
    with corpus.open("rb") as f:
        position = 0
        for number, line in enumerate(f, 1):
            if line.strip():
                offsets.append(position)
                texts.append(_contents(corpus, number, line))
            position += len(line)
    if not texts:
        raise CorpusError(f"{corpus} holds no passages")
    retriever = bm25s.BM25()
    retriever.index(_tokenize(texts), show_progress=False)
    retriever.save(str(folder), show_progress=False)
    np.save(folder / "offsets.npy", np.asarray(offsets, dtype=np.int64))


def ensure_index(corpus: Path = DEFAULT_CORPUS) -> tuple[Path, bool]:
    """The index folder of `corpus`, built first if missing; and whether this call built it."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    folder = root / corpus_key(corpus)
    if (folder / _DONE).exists():
        return folder, False
    with (root / f"{folder.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also on a crash
        if (folder / _DONE).exists():  # another process built it while we waited
            return folder, False
        _remove_killed_builds(root, folder.name)
        temporary = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=root))
        try:
            started = time.perf_counter()
            _build(corpus, temporary)
            record = {"corpus": str(corpus.resolve()), "seconds": time.perf_counter() - started}
            (temporary / _DONE).write_text(json.dumps(record))
            if folder.exists():  # a folder without the marker: left by an older, broken layout
                shutil.rmtree(folder)
            temporary.rename(folder)
        finally:
            shutil.rmtree(temporary, ignore_errors=True)
    return folder, True


def _remove_killed_builds(root: Path, locked_key: str) -> None:
    """Removes the temporary folders (`.<key>-xxxx`) of builds that were killed: `locked_key`'s,
    whose lock the caller holds, and those of other keys whose lock no process holds. A build
    renames or removes its folder before it lets go of the lock, so such a folder has no writer."""
    for temporary in root.glob(".*-*"):
        key = temporary.name[1:].partition("-")[0]
        if temporary.is_dir() and (key == locked_key or not _held(root / f"{key}.lock")):
            shutil.rmtree(temporary, ignore_errors=True)


def _held(lock: Path) -> bool:
    """Whether a process holds `lock`'s flock (a build of its key is under way)."""
    try:
        descriptor = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)  # let go at the close below
    except BlockingIOError:
        return True
    finally:
        os.close(descriptor)
    return False


class Retriever:
    """BM25 over one corpus; `search(query, k)` returns passages' `contents`."""

    def __init__(self, corpus: Path = DEFAULT_CORPUS) -> None:
        import bm25s
        import numpy as np

        self.corpus = Path(corpus)
        folder, _ = ensure_index(self.corpus)
        self.index: Any = bm25s.BM25.load(str(folder), mmap=True, show_progress=False)
        self.offsets = np.load(folder / "offsets.npy", mmap_mode="r")
        self.file = self.corpus.open("rb")

    def passage(self, number: int) -> str:
        self.file.seek(int(self.offsets[number]))
        return str(json.loads(self.file.readline())["contents"])

    def search(self, query: str, k: int = 3) -> list[str]:
        tokens = _tokenize([query])
        if not any(token in self.index.vocab_dict for token in tokens[0]):
            return []  # only stopwords or unknown words: BM25 has nothing to rank by
        k = min(k, len(self.offsets))
        ids, scores = self.index.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        return [self.passage(int(i)) for i, s in zip(ids[0], scores[0], strict=True) if s > 0]


_default: dict[Path, Retriever] = {}


def search(query: str, k: int = 3, corpus: Path = DEFAULT_CORPUS) -> list[str]:
    """The top-`k` passages for `query` (a process keeps one loaded retriever per corpus)."""
    corpus = Path(corpus)
    if corpus not in _default:
        _default[corpus] = Retriever(corpus)
    return _default[corpus].search(query, k)


def format_passages(passages: list[str]) -> str:
    """Search-R1's layout: `Doc 1(Title: ...) text`, one passage per line."""
    if not passages:
        return "No results."
    lines = []
    for number, contents in enumerate(passages, 1):
        title, _, text = contents.partition("\n")
        lines.append(f"Doc {number}(Title: {title.strip().strip(chr(34))}) {text.strip()}")
    return "\n".join(lines)
