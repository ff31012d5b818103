"""How stale a rollout is when it is trained, from the weight version that served each call.

A rollout's staleness is the number of updates between the *oldest* weights that served any of
its calls and the weights being trained (paper section 2.4: one rollout's calls can be served by
several versions when an update lands mid-rollout). Counted along the run's lineage, the versions
its weights went through in order, so a version a crash discarded is infinitely stale.
"""

from __future__ import annotations

import math
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


def certain_drop(
    rollout_versions: Iterable[Sequence[int | None]],
    trained_version: int,
    lineage: Sequence[int],
    *,
    max_staleness: int,
    drop_stale: bool,
    drop_spanning: bool,
) -> str | None:
    """Why a group whose rollouts' calls so far were served by `rollout_versions` (one list per
    rollout) will be dropped whatever its rollouts do next, or None when it may still be
    trained. A staleness only grows (the trained version only moves on) and a rollout whose
    calls spanned an update keeps having spanned it, so the trainer's rules (`max_staleness`
    with `stale_groups: drop`, weights a crash discarded, `spanning_rollouts: drop`) can tell
    before the group finishes."""
    versions = [list(v) for v in rollout_versions]
    stale = max((rollout_staleness(v, trained_version, lineage) for v in versions), default=0.0)
    if math.isinf(stale):
        return "a call was served by weights a crash discarded"
    if stale > max_staleness and drop_stale:
        return f"a call was served {stale:.0f} updates back (max_staleness {max_staleness})"
    if drop_spanning and any(spans_update(v) for v in versions):
        return "a rollout's calls spanned an update (spanning_rollouts: drop)"
    return None
