"""Token reuse on and off: how many real-client rollouts are one training sequence.

One embedded engine (the default model) and two gateways in front of it, one with
`token_reuse` off (the default) and one with it on. The `openai` SDK holds the same kind of
conversation through each (`tests/harness/conversations.py`: the weather tool offered, 4 calls,
a tool's result or a follow-up question after each answer, `train` mode so temperature 1),
streamed and not; `--conversations` of each cell, all at once. Each rollout's recorded calls go
through the sample adapter (dedup, merge, split diagnosis), as the trainer reads them.

    .venv/bin/python benchmarks/token_reuse.py                    # 4 conversations per cell
    .venv/bin/python benchmarks/token_reuse.py --conversations 8

Prints per cell: rollouts, calls, tool-call answers, the one-sequence rollout ratio, samples
(training sequences) per rollout and the split reasons; the last line is the headline:
`token_reuse_one_sequence_ratio: VALUE ratio` (reuse on, the lower of streamed and plain).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from reins.gateway import GatewaySettings  # noqa: E402
from tests.conftest import ADMIN_KEY  # noqa: E402
from tests.embedded_support import ServedEngine, served_engine  # noqa: E402
from tests.harness.conftest import (  # noqa: E402
    Rollout,
    gateway_for,
    open_rollout,
    training_sequences,
)
from tests.harness.conversations import weather_conversation  # noqa: E402


def one_rollout(url: str, engine: ServedEngine, stream: bool) -> tuple[int, int, int, list[str]]:
    """(calls, tool-call answers, training sequences, split reasons) of one conversation."""
    rollout: Rollout = open_rollout(url, engine)
    sdk = openai.OpenAI(base_url=rollout.base_url, api_key=rollout.token, timeout=600)
    received = weather_conversation(sdk, rollout.model, stream=stream)
    calls = rollout.calls()
    sequences, reasons = training_sequences(calls, engine)
    tools = sum(1 for message in received if message.get("tool_calls"))
    return len(calls), tools, sequences, reasons


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=4, help="per cell")
    args = parser.parse_args()
    headline: list[float] = []
    cells = [(reuse, stream) for reuse in (False, True) for stream in (True, False)]
    with contextlib.ExitStack() as stack:
        engine = stack.enter_context(served_engine())
        urls = {reuse: stack.enter_context(gateway(engine, reuse=reuse)) for reuse in (False, True)}
        # Every conversation of every cell at once: the engine batches them (16 by default), so
        # the cells share the machine's noise alike.
        work = [cell for cell in cells for _ in range(args.conversations)]
        with ThreadPoolExecutor(len(work)) as pool:
            done = list(
                pool.map(
                    one_rollout,
                    [urls[reuse] for reuse, _ in work],
                    [engine] * len(work),
                    [stream for _, stream in work],
                )
            )
    print(
        f"{'reuse':<6} {'client':<9} {'rollouts':>8} {'calls':>6} {'tools':>6} "
        f"{'1-seq':>6} {'samples/rollout':>16}  splits"
    )
    for reuse, stream in cells:
        results = [r for r, cell in zip(done, work, strict=True) if cell == (reuse, stream)]
        one = sum(1 for _, _, sequences, _ in results if sequences == 1)
        ratio = one / len(results)
        samples = sum(r[2] for r in results) / len(results)
        reasons = Counter(reason for r in results for reason in r[3])
        print(
            f"{'on' if reuse else 'off':<6} {'streamed' if stream else 'plain':<9} "
            f"{len(results):>8} {sum(r[0] for r in results):>6} "
            f"{sum(r[1] for r in results):>6} {ratio:>6.2f} {samples:>16.2f}  "
            f"{dict(reasons) or '-'}"
        )
        if reuse:
            headline.append(ratio)
    print(f"token_reuse_one_sequence_ratio: {min(headline):.2f} ratio")


@contextlib.contextmanager
def gateway(engine: ServedEngine, *, reuse: bool) -> Iterator[str]:
    """A gateway (SQLite in a temporary folder) with `token_reuse` as given, the engine
    registered; its URL."""
    with tempfile.TemporaryDirectory() as folder:
        settings = GatewaySettings(
            database_url=str(Path(folder) / "gateway.db"), api_key=ADMIN_KEY, token_reuse=reuse
        )
        with gateway_for(settings, engine) as (url, _):
            yield url


if __name__ == "__main__":
    main()
