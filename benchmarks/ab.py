"""Two checkouts of trustrl side by side on the benchmark cases: old and new, interleaved.

    .venv/bin/python benchmarks/ab.py OLD_CHECKOUT NEW_CHECKOUT [--cases 1,4] [--pairs 7]

Each run is a fresh process of that checkout's own ``benchmarks/worker.py`` (side
"trustrl"), importing that checkout's ``trustrl/``, so each side is measured with the
benchmark code it shipped with. Pair *i* runs case by case, old then new, both with seed
``--seed + i``: runs minutes apart on a machine whose speed drifts, so the table reports
each pair's new/old SPS ratio and their median, the figure a claim may use. An old
checkout is typically a worktree of a past commit (``git worktree add /tmp/old COMMIT``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def run(checkout: Path, case: int, seed: int, timeout: float) -> dict[str, Any]:
    job = {"case": case, "side": "trustrl", "seed": seed, "quick": False}
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    done = subprocess.run(
        [sys.executable, str(checkout / "benchmarks" / "worker.py"), json.dumps(job)],
        capture_output=True,
        text=True,
        env=env,
        cwd=checkout,
        timeout=timeout,
    )
    for line in done.stdout.splitlines():
        if line.startswith("BENCH_RESULT "):
            result: dict[str, Any] = json.loads(line.removeprefix("BENCH_RESULT "))
            return result
    raise RuntimeError(f"{checkout} case {case}: no result\n{done.stderr[-2000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--cases", default="1,4")
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", type=Path, default=None, help="write every number here")
    args = parser.parse_args()
    cases = [int(c) for c in args.cases.split(",")]
    rows: list[dict[str, Any]] = []
    for pair in range(args.pairs):
        for case in cases:
            seed = args.seed + pair
            old = run(args.old.resolve(), case, seed, args.timeout)
            new = run(args.new.resolve(), case, seed, args.timeout)
            row = {"case": case, "pair": pair, "seed": seed, "old": old["sps"], "new": new["sps"]}
            row["ratio"] = new["sps"] / old["sps"]
            rows.append(row)
            print(
                f"case {case} pair {pair}: old {old['sps']:,.0f} SPS, new {new['sps']:,.0f} "
                f"SPS, new/old {row['ratio']:.3f}",
                flush=True,
            )
    print("\n| case | pairs | old SPS (median) | new SPS (median) | new/old, median of pairs |")
    print("| --- | --- | --- | --- | --- |")
    for case in cases:
        mine = [r for r in rows if r["case"] == case]
        print(
            f"| {case} | {len(mine)} | {statistics.median(r['old'] for r in mine):,.0f} | "
            f"{statistics.median(r['new'] for r in mine):,.0f} | "
            f"{statistics.median(r['ratio'] for r in mine):.3f} |"
        )
    if args.json is not None:
        stamp = time.strftime("%Y-%m-%d %H:%M")
        args.json.write_text(json.dumps({"written": stamp, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
