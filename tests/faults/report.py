"""Print the fault matrix from the results file that ``make faults`` has pytest write.

Usage: ``python tests/faults/report.py .faults-results.json``
"""

from __future__ import annotations

import json
import sys
from collections import Counter

COLUMNS = ("committed", "lost", "corrupt_returned", "typed", "untyped")


def _name(test: str) -> str:
    file, _, name = test.partition("::")
    return f"{file.rsplit('/', 1)[-1].removesuffix('.py').removeprefix('test_')}: {name.removeprefix('test_')}"


def main(path: str) -> int:
    try:
        with open(path) as f:
            rows = json.load(f)
    except (OSError, ValueError) as e:
        print(f"no fault-matrix results in {path}: {e}")
        return 1
    width = max(len(_name(r["test"])) for r in rows)
    head = f"{'scenario':<{width}}  {'result':<7} " + " ".join(f"{c:>9}" for c in ("committed", "lost", "corrupt",
                                                                                    "typed", "untyped"))
    print(head)
    print("-" * len(head))
    totals: Counter = Counter()
    codes: Counter = Counter()
    outcomes: Counter = Counter()
    for r in rows:
        outcomes[r["outcome"]] += 1
        vals = [r.get(c, 0) for c in COLUMNS]
        totals.update(dict(zip(COLUMNS, vals)))
        if "test_fuzz" in r["test"]:
            codes.update(r.get("codes", {}))
        line = f"{_name(r['test']):<{width}}  {r['outcome']:<7} " + " ".join(f"{v:>9}" for v in vals)
        if r["outcome"] == "skipped":
            line += f"  ({r.get('reason', '')})"
        print(line)
    print("-" * len(head))
    print(f"{'total':<{width}}  {'':<7} " + " ".join(f"{totals[c]:>9}" for c in COLUMNS))
    print("results: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
    grpc_codes = {k: v for k, v in codes.items() if not k.startswith("bulk:")}
    bulk = {k[5:]: v for k, v in codes.items() if k.startswith("bulk:")}
    print(f"fuzz gRPC status codes ({sum(grpc_codes.values())} requests): "
          + ", ".join(f"{k} {v}" for k, v in sorted(grpc_codes.items())))
    print(f"fuzz bulk-port outcomes ({sum(bulk.values())} requests): "
          + ", ".join(f"{k} {v}" for k, v in sorted(bulk.items())))
    bad = {k: v for k, v in codes.items() if k.split(":")[-1] in ("UNKNOWN", "INTERNAL")}
    print(f"untyped statuses (UNKNOWN/INTERNAL) for bad input: {sum(bad.values())}")
    return 0 if not outcomes.get("failed") and not totals["lost"] and not totals["corrupt_returned"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ".faults-results.json"))
