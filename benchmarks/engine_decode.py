"""The embedded engine's decode step at agent context lengths: transformers' `sdpa` attention
against the engine's (`reins.engine.attention`), in one process, on the default model (float32).

For each context length (default 512, 2048 and 4400 tokens, one row) the scheduler prefills a
random prompt, then runs decode steps, switching the model's attention implementation between
the two every few steps (interleaved rounds, so that a busy machine slows both alike); each
figure is the median over rounds of the process's CPU time per step (both threads; steadier than
wall time when the machine is shared) and of the wall time. Then a prefill of `--new` tokens over
a cached prefix of the longest context (what a later turn of a conversation does), both ways.
The scheduler is driven from this thread while its own thread idles (nothing is submitted).

    .venv/bin/python benchmarks/engine_decode.py                   # 3-6 minutes on 2 cores
    .venv/bin/python benchmarks/engine_decode.py --contexts 4400 --rows 8

The last line is the headline: CPU time per decode step at the longest context, transformers'
`sdpa` over the engine's attention: `engine_decode_step_speedup: VALUE x`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

IMPLEMENTATIONS = ("sdpa", "reins_sdpa")
"""Baseline first: transformers' own attention, then the engine's."""


def _timed(run: Callable[[], None], repeat: int) -> tuple[float, float]:
    """(CPU ms, wall ms) per call of `run`, over `repeat` calls."""
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(repeat):
        run()
    return (
        (time.process_time() - cpu) * 1e3 / repeat,
        (time.perf_counter() - wall) * 1e3 / repeat,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="512,2048,4400", help="context lengths (tokens)")
    parser.add_argument("--rows", type=int, default=1, help="sequences decoded together")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per context")
    parser.add_argument("--steps", type=int, default=3, help="decode steps per round and side")
    parser.add_argument("--new", type=int, default=120, help="tokens prefilled over the cache")
    parser.add_argument("--omp-active", action="store_true", help="keep OpenMP's wait policy")
    args = parser.parse_args()
    if not args.omp_active:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP

    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.engine import _load
    from reins.engine.prefix_cache import PrefixCache
    from reins.engine.prepare import prepare_default_model
    from reins.engine.sampling import SamplingParams
    from reins.engine.scheduler import BatchScheduler, Sequence

    model_dir = prepare_default_model()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    scheduler = BatchScheduler(
        model,
        eos_token_ids=set(),
        decode=lambda ids: "",
        max_batch=args.rows,
        max_model_len=1 << 20,
        prefix_cache=PrefixCache(4 * 2**30),
    )
    contexts = [int(c) for c in args.contexts.split(",")]
    print(
        f"reins decode-step benchmark: {os.cpu_count()} CPU cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {args.rows} row(s), float32, load {_load()}, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}",
        flush=True,
    )
    generator = torch.Generator().manual_seed(0)

    def sequence(prompt: list[int], seed: int) -> Sequence:
        params = SamplingParams(max_tokens=1 << 20, seed=seed)
        return Sequence(prompt, params, lambda *_: None, lambda *_: None)

    def reset() -> None:
        scheduler._active, scheduler._cache, scheduler._mask = [], None, None

    def use(name: str) -> None:
        model.set_attn_implementation(name)

    ratio = 1.0
    prompt: list[int] = []
    with torch.inference_mode():
        for context in contexts:
            prompts = [
                torch.randint(100, 40_000, (context - 5 * row,), generator=generator).tolist()
                for row in range(args.rows)
            ]
            prompt = prompts[0]
            reset()
            scheduler._prefill_and_join([sequence(p, row) for row, p in enumerate(prompts)])
            results: dict[str, list[tuple[float, float]]] = {n: [] for n in IMPLEMENTATIONS}
            for _ in range(args.rounds):
                for name in IMPLEMENTATIONS:
                    use(name)
                    results[name].append(_timed(scheduler._decode_step, args.steps))
            cpu = {n: statistics.median(r[0] for r in v[1:]) for n, v in results.items()}
            wall = {n: statistics.median(r[1] for r in v[1:]) for n, v in results.items()}
            ratio = cpu["sdpa"] / cpu["reins_sdpa"]
            print(
                f"decode step at {context:5d} tokens: CPU {cpu['sdpa']:6.1f} -> "
                f"{cpu['reins_sdpa']:6.1f} ms ({ratio:.2f}x), wall {wall['sdpa']:6.1f} -> "
                f"{wall['reins_sdpa']:6.1f} ms ({wall['sdpa'] / wall['reins_sdpa']:.2f}x)",
                flush=True,
            )
        reset()
        # A later turn: the prompt so far is cached, `--new` tokens are prefilled over it.
        version = scheduler.weight_generation()
        longer = prompt + torch.randint(100, 40_000, (args.new,), generator=generator).tolist()
        prefill: dict[str, list[tuple[float, float]]] = {n: [] for n in IMPLEMENTATIONS}
        for _ in range(3):
            for name in IMPLEMENTATIONS:
                use(name)
                joining = sequence(longer, 0)
                joining.match = scheduler.prefix_cache.lookup(joining.prompt_tokens, version)
                assert joining.match is not None, "the prompt's prefix should be cached"
                prefill[name].append(_timed(lambda: scheduler._prefill([joining]), 1))  # noqa: B023
                reset()
        cpu = {n: statistics.median(r[0] for r in v) for n, v in prefill.items()}
        print(
            f"prefill of {args.new} tokens over {len(prompt)} cached: CPU {cpu['sdpa']:7.1f} -> "
            f"{cpu['reins_sdpa']:7.1f} ms ({cpu['sdpa'] / cpu['reins_sdpa']:.2f}x)",
            flush=True,
        )
    scheduler.stop()
    print(f"engine_decode_step_speedup: {ratio:.2f} x")


if __name__ == "__main__":
    main()
