"""How stale a rollout is when it is trained, from the weight version that served each call.

A rollout's staleness is the number of updates between the *oldest* weights that served any of
its calls and the weights being trained (paper section 2.4: one rollout's calls can be served by
several versions when an update lands mid-rollout). Counted along the run's lineage, the versions
its weights went through in order, so a version a crash discarded is infinitely stale.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def rollout_staleness(
    versions: Iterable[int | None], trained_version: int, lineage: Sequence[int]
) -> float:
    """Updates between the oldest version among `versions` (a rollout's calls'; None: unknown,
    left out) and `trained_version`; 0 for a rollout with no known version; infinite when a
    version is not on `lineage`."""
    index = {version: i for i, version in enumerate(lineage)}
    known = [v for v in versions if v is not None]
    if not known:
        return 0.0
    if trained_version not in index or any(v not in index for v in known):
        return float("inf")
    return float(index[trained_version] - min(index[v] for v in known))


def spans_update(versions: Iterable[int | None]) -> bool:
    """Whether the calls were served by more than one weight version (an update landed mid-way)."""
    return len({v for v in versions if v is not None}) > 1


def version_lags(lineage: Sequence[int]) -> dict[int, int]:
    """Each version of `lineage` -> updates behind its last (the weights trained now)."""
    return {version: len(lineage) - 1 - i for i, version in enumerate(lineage)}
