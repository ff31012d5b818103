"""A rank of a sharded run ends through `reins.trainer.ranks.exit_rank`: with its own exit
status, its exit handlers run and its output flushed.

Real: two processes in a gloo process group on 127.0.0.1 (tests/trainer/exit_worker.py). Why
ranks end so: ending through the interpreter's finalization aborted 7 of 65 two-rank FSDP runs
of tests/trainer/fsdp_worker.py on 2 busy cores (`terminate called without an active
exception`: a gloo thread dropping a collective's tensors after the main thread returned), and
torchrun reported the finished runs as failed. The race is too rare to assert on in a test of
bounded time; the FSDP tests' torchrun runs go through `exit_rank` too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support import free_port
from tests.trainer.test_fsdp_train import _reins_train, run_fields

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _run_pair(code: int, mark: Path) -> list[subprocess.CompletedProcess[str]]:
    port = free_port()
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.trainer.exit_worker", str(code), str(mark)],
            cwd=ROOT,
            env={
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "GLOO_SOCKET_IFNAME": "lo",
                "OMP_NUM_THREADS": "1",
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    done = []
    for process in processes:
        try:
            stdout, stderr = process.communicate(timeout=120)
        finally:
            process.kill()
        done.append(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr))
    return done


def test_a_rank_ends_with_its_code_its_exit_handlers_run_and_its_output_flushed(
    tmp_path: Path,
) -> None:
    ranks = _run_pair(3, tmp_path / "mark")
    assert [rank.returncode for rank in ranks] == [3, 3], [rank.stderr[-2000:] for rank in ranks]
    assert [rank.stdout for rank in ranks] == ["rank 0 done", "rank 1 done"]
    assert (tmp_path / "mark-0").read_text() == "ran"
    assert (tmp_path / "mark-1").read_text() == "ran"


def test_the_other_ranks_of_a_run_that_failed_on_rank_0_do_not_say_done(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A sharded run refused on rank 0 (here `--resume` of a run that does not exist, refused
    before any backend call) ended rank 1 as a finished run: exit 0 and `done: metrics in ...`
    under rank 0's error."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(run_fields(tmp_path, tiny_model_dir)))
    result = _reins_train(config, "--resume")
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert "there is no run 'sharded' to resume" in output, output[-3000:]
    assert "rank 0 stopped with an error" in output, output[-3000:]
    assert "done: metrics in" not in output, output[-3000:]
    # Rank 1 ends on its one line, not a traceback of its own (torchrun prints its own).
    assert "error: rank 0 stopped with an error" in output, output[-3000:]
    assert "RankZeroFailed" not in output, output[-3000:]
    assert output.count("run sharded: 4 steps") == 1, output[-3000:]  # rank 0's alone
