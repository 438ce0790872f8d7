"""Run one benchmark function in this fresh interpreter and print its JSON result on one marked line.

    python -m benchmarks.child MODULE FUNC KWARGS_JSON [CPU]

calls ``benchmarks.MODULE.FUNC(**KWARGS_JSON)`` and prints ``RESULT_MARK + json.dumps(result)``; ``CPU``: pin
this process to that core first. Started from the repository root (``cwd``), so ``benchmarks`` and ``unialign``
import from the checkout with no path set up: ``common.run_child`` (clean RSS peaks) and P9's two sides (ours in
this environment, TRL 0.23 in its own) use it.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> None:
    module, func, kwargs = argv[:3]
    if len(argv) > 3:
        os.sched_setaffinity(0, {int(argv[3])})
    import importlib
    import json

    from benchmarks.common import RESULT_MARK

    result = getattr(importlib.import_module(f"benchmarks.{module}"), func)(**json.loads(kwargs))
    print(RESULT_MARK + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
