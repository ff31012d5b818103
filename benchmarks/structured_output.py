"""What structured output costs the embedded engine per decode step: rows whose answer follows a
JSON schema (`reins.engine.constraint`: a grammar mask computed, applied and advanced per row and
step) against the same rows sampled freely, in one process, on the default model (float32).

For each batch size (default 1 and 8 rows) the scheduler prefills two batches of the same random
prompts (`--context` tokens), one constrained, one free, then runs decode steps on each in turn
(interleaved rounds, so that a busy machine slows both alike). Each figure is the median over
rounds of the process's CPU time per step (both threads) and of the wall time. The schema (an
array of at least 10,000 integers) never completes, so every step is constrained.

    .venv/bin/python benchmarks/structured_output.py                 # about 1 minute on 2 cores
    .venv/bin/python benchmarks/structured_output.py --rows 1,8,16 --rounds 15

The last line is the headline: the CPU time a step gains with every row constrained, at the
largest batch, over the free step: `structured_output_step_overhead: VALUE %`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCHEMA = {"type": "array", "items": {"type": "integer"}, "minItems": 10_000}
"""An answer that never completes within the benchmark: every step is constrained."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8", help="batch sizes (rows decoded together)")
    parser.add_argument("--context", type=int, default=256, help="prompt tokens per row")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds per batch size")
    parser.add_argument("--steps", type=int, default=4, help="decode steps per round and side")
    args = parser.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.engine import _load
    from benchmarks.engine_decode import _timed
    from reins.engine.constraint import Grammars, format_grammar
    from reins.engine.prefix_cache import PrefixCache
    from reins.engine.prepare import prepare_default_model
    from reins.engine.sampling import SamplingParams
    from reins.engine.scheduler import BatchScheduler, Sequence

    model_dir = prepare_default_model()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    grammars = Grammars(tokenizer, {tokenizer.eos_token_id})
    grammar = format_grammar({"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    assert grammar is not None
    grammars.check(grammar)  # builds the tokenizer's index once, outside the timings
    batch_sizes = [int(r) for r in args.rows.split(",")]
    scheduler = BatchScheduler(
        model,
        eos_token_ids={tokenizer.eos_token_id},
        decode=lambda ids: "",
        max_batch=max(batch_sizes),
        max_model_len=1 << 20,
        prefix_cache=PrefixCache(0),
    )
    print(
        f"reins structured-output benchmark: {os.cpu_count()} CPU cores, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads, {args.context}-token prompts, "
        f"float32, load {_load()}",
        flush=True,
    )
    generator = torch.Generator().manual_seed(0)

    def sequence(prompt: list[int], seed: int, constrained: bool) -> Sequence:
        params = SamplingParams(
            max_tokens=1 << 20, seed=seed, grammar=grammar if constrained else None
        )
        row = Sequence(prompt, params, lambda *_: None, lambda *_: None)
        if constrained:
            row.matcher = grammars.matcher(grammar)
        return row

    def batch(prompts: list[list[int]], constrained: bool) -> tuple[Any, Any, Any]:
        scheduler._active, scheduler._cache, scheduler._mask = [], None, None
        rows = [sequence(prompt, row, constrained) for row, prompt in enumerate(prompts)]
        scheduler._prefill_and_join(rows)
        return scheduler._active, scheduler._cache, scheduler._mask

    overhead = 0.0
    with torch.inference_mode():
        for rows in batch_sizes:
            prompts = [
                torch.randint(100, 40_000, (args.context,), generator=generator).tolist()
                for _ in range(rows)
            ]
            states = {"free": batch(prompts, False), "constrained": batch(prompts, True)}
            results: dict[str, list[tuple[float, float]]] = {name: [] for name in states}
            for _ in range(args.rounds):
                for name, state in states.items():
                    scheduler._active, scheduler._cache, scheduler._mask = state
                    results[name].append(_timed(scheduler._decode_step, args.steps))
                    states[name] = (scheduler._active, scheduler._cache, scheduler._mask)
            assert all(s.finish_reason is None for s in states["constrained"][0]), "ended early"
            cpu = {n: statistics.median(r[0] for r in v[1:]) for n, v in results.items()}
            wall = {n: statistics.median(r[1] for r in v[1:]) for n, v in results.items()}
            overhead = 100 * (cpu["constrained"] / cpu["free"] - 1)
            print(
                f"{rows:2d} row(s): decode step CPU {cpu['free']:6.1f} -> "
                f"{cpu['constrained']:6.1f} ms ({overhead:+.1f} %), wall {wall['free']:6.1f} -> "
                f"{wall['constrained']:6.1f} ms, "
                f"{(cpu['constrained'] - cpu['free']) / rows:.2f} ms CPU per constrained row",
                flush=True,
            )
    scheduler.stop()
    print(f"structured_output_step_overhead: {overhead:.1f} %")


if __name__ == "__main__":
    main()
