"""build_batch end to end: provenance, refusals, and the adapter's import boundary."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import numpy as np
import pytest
from samples_factory import call, continuing, record

import reins.samples
from reins.samples import build_batch


def test_sequences_keep_rollout_group_attempt_calls_and_versions() -> None:
    c1 = call([1, 2], [3], seq=4, version=7)
    c2 = continuing(c1, [5], [6], seq=9)
    c2.model_version = 8
    batch = build_batch([record("r-1", [c1, c2], reward=1.0, group_id="g-1", attempt_id=2)])
    (s,) = batch.sequences
    assert (s.rollout_id, s.group_id, s.attempt_id, s.reward) == ("r-1", "g-1", 2, 1.0)
    assert (s.call_seqs, s.model_versions) == ((4, 9), (7, 8))
    assert s.token_ids.tolist() == [1, 2, 3, 5, 6]
    assert s.token_ids.dtype == np.int32
    assert s.response_spans == ((2, 3), (4, 5))


def test_a_rollout_passed_twice_is_refused() -> None:
    r = record("r-1", [call([1], [2])])
    with pytest.raises(ValueError, match=r"rollouts \['r-1'\] appear more than once"):
        build_batch([r, r])


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), -float("inf")])
def test_a_reward_that_is_no_finite_number_is_refused_naming_its_rollout(reward: float) -> None:
    """It made every advantage of its group NaN (RLOO: -inf too), silently; a trainer's loss
    was then NaN and the whole mini-batch's step was skipped, the other groups' signal too."""
    records = [
        record("r-0", [call([1], [2])], reward=reward, group_id="g"),
        record("r-1", [call([1], [3])], reward=1.0, group_id="g"),
    ]
    with pytest.raises(ValueError, match=rf"^rollout r-0 has reward {reward}: a reward must be"):
        build_batch(records)


def test_unknown_options_are_refused_with_the_valid_ones() -> None:
    from reins.samples import AdapterConfig

    r = record("r-1", [call([1], [2])])
    with pytest.raises(ValueError, match="use one of token-mean"):
        build_batch([r], AdapterConfig(loss_aggregation="sum"))  # type: ignore[arg-type]


def test_the_adapter_imports_only_numpy_the_stdlib_and_schemas() -> None:
    allowed = set(sys.stdlib_module_names) | {"numpy", "reins"}
    for path in Path(reins.samples.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"
                if name.startswith("reins."):
                    assert name == "reins.schemas" or name.startswith("reins.samples"), name
