"""Profile trustrl's hot loop on one benchmark case: the phase split and cProfile's top entries.

    .venv/bin/python benchmarks/profile_case.py --case 1 --steps 30000
    .venv/bin/python benchmarks/profile_case.py --case 6 --steps 200000 --top 25
    PYTHONPATH=/path/to/other/checkout .venv/bin/python benchmarks/profile_case.py --case 1

The case's settings come from ``benchmarks/cases.py`` (``--steps`` shortens the run). The
trainer is built before the profiler starts, so imports and construction are left out.
Printed: wall time and SPS under the profiler (which inflates Python-heavy code more than
native code, so compare profiles with profiles, not with benchmark SPS), the share of
time in collection and in the update, then the top entries by own time. Used for
docs/performance.md.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cases


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", type=int, default=1, choices=sorted(cases.CASES))
    parser.add_argument("--steps", type=int, default=30_000, help="env steps to profile")
    parser.add_argument("--top", type=int, default=15, help="entries to print")
    parser.add_argument("--sort", default="tottime", help="pstats sort key (tottime, cumtime)")
    args = parser.parse_args()

    import trustrl
    from trustrl.config import config_from_dict

    settings = cases.settings(args.case)
    settings["total_steps"] = args.steps
    with tempfile.TemporaryDirectory(prefix="trustrl-profile-") as run_dir:
        trainer = trustrl.Trainer(config_from_dict(cases.trustrl_table(settings, 1, run_dir)))
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.enable()
        trainer.train()
        profile.disable()
        wall = time.perf_counter() - start

    stats = pstats.Stats(profile)
    phases = {"collect": 0.0, "update": 0.0}
    for (filename, _, name), row in stats.stats.items():  # type: ignore[attr-defined]
        if filename.endswith(("collect.py", "collector.py")) and name == "collect":
            phases["collect"] += row[3]
        if filename.endswith("trainer.py") and name == "_update":
            phases["update"] += row[3]
    print(f"trustrl {Path(trustrl.__file__).parent}")
    print(f"case {args.case}: {trainer.env_steps:,} env steps in {wall:.2f} s under the profiler")
    print(f"({trainer.env_steps / wall:,.0f} SPS)", end="")
    for phase, seconds in phases.items():
        print(f", {phase} {seconds:.2f} s ({seconds / wall:.0%})", end="")
    print()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats(args.sort).print_stats(args.top)
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    start_at = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
    print("\n".join(lines[start_at:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
