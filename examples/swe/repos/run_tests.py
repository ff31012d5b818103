"""The repository's test runner (standard library only, so any python3 runs it).

python3 run_tests.py [TEST_ID ...]   # TEST_ID: tests/test_text.py::test_slugify_keeps_digits

Runs every `test_*` function of tests/test_*.py (or the ones named) and prints one line per test
in pytest's `-rA` summary form, `PASSED <id>` or `FAILED <id>`, then a count. Exit status 0
when every test ran passed.
"""

import importlib.util
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent


def load(path: Path):
    spec = importlib.util.spec_from_file_location(f"tests.{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def collect(wanted: set[str]) -> list[tuple[str, object]]:
    found = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if wanted and not any(test.startswith(relative + "::") for test in wanted):
            continue
        try:
            module = load(path)
        except Exception:
            traceback.print_exc()
            found += [(test, None) for test in sorted(wanted) if test.startswith(relative)]
            continue
        for name in sorted(vars(module)):
            test_id = f"{relative}::{name}"
            if name.startswith("test_") and (not wanted or test_id in wanted):
                found.append((test_id, getattr(module, name)))
    return found


def main() -> int:
    sys.path.insert(0, str(ROOT))
    wanted = set(sys.argv[1:])
    tests = collect(wanted)
    missing = wanted - {test_id for test_id, _ in tests}
    results = []
    for test_id, function in tests:
        try:
            if function is None:
                raise ImportError("the test file does not import")
            function()
            results.append(("PASSED", test_id))
        except Exception:
            print(f"--- {test_id}")
            traceback.print_exc(limit=-2)
            results.append(("FAILED", test_id))
    results += [("FAILED", test_id) for test_id in sorted(missing)]
    print("=" * 20, "short test summary info", "=" * 20)
    for outcome, test_id in results:
        print(outcome, test_id)
    failed = sum(outcome == "FAILED" for outcome, _ in results)
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
