"""Train the reference configs and write what the reference test compares.

    python tests/reference/make.py OUT_DIR [NAME ...]

For each ``configs/NAME.toml`` (explicit configs, no preset mixed in) it trains in
``OUT_DIR/NAME/run`` with whatever ``trustrl`` is first on the path, then writes
``OUT_DIR/NAME/progress.csv`` (the run's progress file without its two clock columns,
``sps`` and ``wall_time``) and ``OUT_DIR/NAME/weights.safetensors`` (the final policy's
``state_dict``). It uses only the public API and the config module, so the same file
runs at the commit that made the stored references (``COMMIT``) and at any later one.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIGS = HERE / "configs"
CLOCKS = ("sps", "wall_time")


def make(name: str, out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    import trustrl
    from trustrl.config import config_from_dict, read_toml

    folder = out / name
    table = read_toml(CONFIGS / f"{name}.toml")
    table.update(run_dir=str(folder / "run"), quiet=True)
    torch.set_num_threads(1)
    policy = trustrl.Trainer(config_from_dict(table), overwrite=True).train()
    with open(folder / "run" / "progress.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    columns = [c for c in rows[0] if c not in CLOCKS]
    with open(folder / "progress.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, columns, extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    weights = {k: v.detach().clone().contiguous() for k, v in policy.state_dict().items()}
    save_file(weights, str(folder / "weights.safetensors"))


def main() -> None:
    out = Path(sys.argv[1])
    names = sys.argv[2:] or sorted(p.stem for p in CONFIGS.glob("*.toml"))
    for name in names:
        make(name, out)
        print(f"{name}: written to {out / name}", flush=True)


if __name__ == "__main__":
    main()
