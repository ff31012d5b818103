"""The local controller's tail of an agent's log (`reins.controller.local._tail`, which goes into
the attempt's `agent_log` event), on real files: the harness can write its folder, so the log
may be a link or a FIFO, or still growing. Each read runs in a child process with a memory
limit and a deadline, so a read without a bound fails the test instead of the machine."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from reins.controller.loop import TAIL_BYTES

READ_TAIL = (
    "import resource, sys\n"
    "from pathlib import Path\n"
    "resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
    "from reins.controller.local import _tail\n"
    "sys.stdout.write(repr(_tail(Path(sys.argv[1]))))\n"
)


def tail_of(path: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-c", READ_TAIL, str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return str(ast.literal_eval(done.stdout))  # the repr of a str


def test_the_tail_is_the_logs_last_bytes(tmp_path: Path) -> None:
    log = tmp_path / "agent.log"
    log.write_bytes(b"x" * 10_000 + b"the end\n")
    assert tail_of(log) == ("x" * 10_000 + "the end\n")[-TAIL_BYTES:]
    assert tail_of(tmp_path / "missing.log") == ""


def test_a_log_the_agent_replaced_by_a_link_or_a_fifo_is_not_read(tmp_path: Path) -> None:
    """The tail seeked to 4 KB before the end and then read with no bound: a log linked to
    `/dev/zero` (whose end is 0) was read until the controller's memory ran out, a FIFO's open
    waited for a writer forever, and a link to a host file put that file's end into an event."""
    zero = tmp_path / "zero.log"
    zero.symlink_to("/dev/zero")
    secret = tmp_path / "secret"
    secret.write_text("a host file's content\n")
    linked = tmp_path / "linked.log"
    linked.symlink_to(secret)
    fifo = tmp_path / "fifo.log"
    os.mkfifo(fifo)
    for log in (zero, linked, fifo):
        assert tail_of(log) == "", log.name
