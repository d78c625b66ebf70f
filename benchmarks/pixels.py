"""The pixel suite: trustrl's MinAtar presets at their 10M-step budget on three seeds, with
a final deterministic and stochastic evaluation, beside gymnax's published PPO figures.

    .venv/bin/python benchmarks/pixels.py --run-root /work/minatar-runs          # train + report
    .venv/bin/python benchmarks/pixels.py --run-root /work/minatar-runs --games Breakout --seeds 1
    .venv/bin/python benchmarks/pixels.py --run-root /work/minatar-runs --report-only
    .venv/bin/python benchmarks/pixels.py --run-root /work/minatar-runs --sticky 0   # gymnax's

One run at a time, seed-major (every game's first seed before any second seed), each
``trustrl train MinAtar/<game>-v1 --seed S`` in a subprocess. A run cut short (the end of
a working session, a kill) resumes from its last checkpoint the next time the suite
starts (``trustrl train --resume``): nothing trained is lost. A finished run is
evaluated once, 100 episodes deterministic and 100 stochastic (the policy samples, as
gymnax's figures do), and marked done (``result.json``).

The presets play the minatar package's games with its sticky actions (0.1, the benchmark as
Young & Tian 2019 define it); gymnax's games, whose figures the table stands beside, have
none. So a run trained with sticky actions is evaluated twice more, 100 episodes each
way on games without them (``trustrl eval --env.kwargs sticky_action_prob 0.0``:
gymnax's evaluation, ``no_sticky`` in its result); a finished run measured before these
existed gets them the next time the suite starts with its run folder there.
``--sticky P`` trains and evaluates with ``sticky_action_prob = P`` instead (``--sticky
0``: gymnax's protocol, training included); each run records its own, and the report
gives each protocol its rows.

The report (stdout, and with ``--write-docs`` the table between the markers of
docs/pixels.md) gives per game and protocol the mean over the finished seeds, the worst
seed, the wall time of a run and gymnax's figure. Run folders do not outlive a machine,
so each finished run's result is also kept in ``docs/benchmarks-pixels/minatar.json``
(``--write-docs`` adds the run root's to it), each with its training curve thinned to
at most ``CURVE_POINTS`` iterations (env steps, the mean return of the iteration's
finished games, the policy's entropy), so that a curve can still be read once its run
folder is gone: the report is of every run measured, in any sitting, a run under the run
root replacing the record of the same game, protocol and seed.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from trustrl.run.logging import read_progress

ROOT = Path(__file__).resolve().parent.parent
TRUSTRL = [sys.executable, "-m", "trustrl.cli"]

# gymnax's README, "PPO" column (an MLP on the flattened grid, 10M steps; the mean return
# of stochastic episodes): https://github.com/RobertTLange/gymnax#implemented-accelerated-environments-
GYMNAX = {"Breakout": 28.0, "SpaceInvaders": 131.0, "Asterix": 15.0, "Freeway": 58.0}
GAMES = ("Breakout", "SpaceInvaders", "Asterix", "Freeway")
EPISODES = 100
KINDS = ("deterministic", "stochastic")
RESULT = "result.json"
PRESET_STICKY = 0.1  # the minatar package's default, which the presets keep
EPISODE_STEPS = 1000  # the presets' max_episode_steps (gymnax's max_steps_in_episode)
MARKERS = ("<!-- pixels-table:start -->", "<!-- pixels-table:end -->")
RECORD = ROOT / "docs" / "benchmarks-pixels" / "minatar.json"
DOC = ROOT / "docs" / "pixels.md"
CURVE_POINTS = 100  # a recorded curve's most iterations (a 10M-step run has 1,220)


def run_dir(root: Path, game: str, seed: int, sticky: float | None = None) -> Path:
    """A run's folder: ``<game>__<seed>`` with the preset's sticky actions, else
    ``<game>__sticky<P>__<seed>``."""
    if sticky is None or sticky == PRESET_STICKY:
        return root / f"{game}__{seed}"
    return root / f"{game}__sticky{sticky:g}__{seed}"


def train(folder: Path, game: str, seed: int, sticky: float | None) -> float:
    """Train (or resume) one run to its preset's budget, with sticky actions of probability
    ``sticky`` (None: the preset's); the wall seconds it took now."""
    start = time.monotonic()
    if (folder / "checkpoints").is_dir() and any((folder / "checkpoints").iterdir()):
        command = [*TRUSTRL, "train", "--resume", str(folder), "--quiet"]
    else:
        env_id = f"MinAtar/{game}-v1"
        command = [*TRUSTRL, "train", env_id, "--seed", str(seed), "--run-dir", str(folder)]
        command += ["--overwrite", "--quiet"]
        if sticky is not None:  # a config over the preset: its env.kwargs with sticky_action_prob
            overlay = folder.parent / f"sticky{sticky:g}.toml"
            kwargs = f"max_episode_steps = {EPISODE_STEPS}, sticky_action_prob = {float(sticky)!r}"
            overlay.write_text(f"[env]\nkwargs = {{ {kwargs} }}\n")
            command += ["--config", str(overlay)]
    subprocess.run(command, check=True, cwd=ROOT)
    return time.monotonic() - start


def evaluate(folder: Path, deterministic: bool, sticky_off: bool = False) -> dict[str, Any]:
    """``EPISODES`` episodes of a run's final policy, on the games it trained on, or with
    ``sticky_off`` on the same games without sticky actions (gymnax's)."""
    flag = "--deterministic" if deterministic else "--no-deterministic"
    command = [*TRUSTRL, "eval", str(folder), "--episodes", str(EPISODES), flag, "--json"]
    if sticky_off:
        command += ["--env.kwargs", "sticky_action_prob", "0.0"]
    done = subprocess.run(command, check=True, cwd=ROOT, capture_output=True, text=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def finish(folder: Path, game: str, seed: int, sticky: float | None) -> None:
    """Evaluate a trained run (with the sticky actions it trained with: the run's config;
    then, where it had some, without them) and mark it done."""
    result = {
        "game": game,
        "seed": seed,
        "sticky": PRESET_STICKY if sticky is None else float(sticky),
        "deterministic": evaluate(folder, True),
        "stochastic": evaluate(folder, False),
    }
    write_result(folder, complete(folder, result))


def complete(folder: Path, result: dict[str, Any]) -> dict[str, Any]:
    """``result`` with its evaluations on games without sticky actions (``no_sticky``),
    for a run that trained with them and has none yet."""
    if result["sticky"] == 0 or "no_sticky" in result:
        return result
    no_sticky = {kind: evaluate(folder, kind == "deterministic", True) for kind in KINDS}
    return {**result, "no_sticky": no_sticky}


def write_result(folder: Path, result: dict[str, Any]) -> None:
    """Mark a run done with its result, atomically."""
    tmp = folder / (RESULT + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(folder / RESULT)


def results(root: Path, record: Path) -> list[dict[str, Any]]:
    """Every measured run: the record's (earlier sittings), replaced by the run root's of
    the same game, protocol and seed; each with its training wall time (``wall_seconds``,
    None where the record has none) and, for the run root's, its thinned training curve
    (``curve``)."""

    def key(result: dict[str, Any]) -> tuple[str, float, int]:
        return result["game"], float(result.get("sticky", PRESET_STICKY)), int(result["seed"])

    found = {key(r): r for r in (json.loads(record.read_text()) if record.is_file() else [])}
    for path in sorted(root.glob(f"*/{RESULT}")):
        result = json.loads(path.read_text())
        progress = read_progress(path.parent / "progress.csv")
        found[key(result)] = {
            **result,
            # the last row's: the trainer carries wall_time over resumed sessions
            "wall_seconds": progress[-1]["wall_time"],
            "curve": _curve(progress),
        }
    return sorted(found.values(), key=key)


def report(found: list[dict[str, Any]]) -> str:
    """The table: per game and training protocol, each evaluation's mean over the seeds
    (the worst seed), and whether the stochastic one is above gymnax's figure, on the
    games trained on and on gymnax's (no sticky actions)."""
    rows = [
        "| game | sticky actions in training | seeds done | deterministic, mean (worst) "
        "| stochastic, mean (worst) | without sticky actions: deterministic "
        "| without sticky actions: stochastic | gymnax PPO (stochastic, no sticky actions) "
        "| above, with sticky actions | above, without (gymnax's games) | wall per run |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for game in GAMES:
        runs = [r for r in found if r["game"] == game]
        if not runs:
            rows.append(f"| {game} | | 0 | not yet measured | | | | {GYMNAX[game]:g} | | | |")
        for sticky in sorted({r.get("sticky", PRESET_STICKY) for r in runs}, reverse=True):
            mine = [r for r in runs if r.get("sticky", PRESET_STICKY) == sticky]
            rows.append(_row(game, sticky, mine))
    return "\n".join(rows)


def _row(game: str, sticky: float, mine: list[dict[str, Any]]) -> str:
    """One protocol's row. Without sticky actions: a run trained without them is
    evaluated so anyway; the seeds measured before those evaluations existed, whose run
    folders are gone, are left out of those columns, which then name their seeds."""
    gymnax = GYMNAX[game]
    walls = [r["wall_seconds"] for r in mine if r.get("wall_seconds") is not None]
    wall = f"{statistics.median(walls) / 60:.0f} min" if walls else "-"
    sto = [r["stochastic"]["mean_return"] for r in mine]
    plain = [r if sticky == 0 else r.get("no_sticky") for r in mine]
    seeds = [r["seed"] for r, p in zip(mine, plain, strict=True) if p is not None]
    off = [p for p in plain if p is not None]
    off_sto = [p["stochastic"]["mean_return"] for p in off]
    some = "" if len(off) in (0, len(mine)) else f", seeds {', '.join(map(str, seeds))}"
    cells = [
        f"{game} | {sticky:g} | {len(mine)} ({', '.join(str(r['seed']) for r in mine)})",
        _mean_worst([r["deterministic"]["mean_return"] for r in mine]),
        _mean_worst(sto),
        _mean_worst([p["deterministic"]["mean_return"] for p in off]) + some,
        _mean_worst(off_sto) + some,
        f"{gymnax:g}",
        "-" if sticky == 0 else _above(sto, gymnax),
        "-" if not off else _above(off_sto, gymnax) + some,
        wall,
    ]
    return "| " + " | ".join(cells) + " |"


def _mean_worst(values: list[float]) -> str:
    return f"{statistics.mean(values):.1f} ({min(values):.1f})" if values else "-"


def _above(values: list[float], figure: float) -> str:
    """Whether the mean of ``values`` is above ``figure``: yes or no."""
    return "yes" if statistics.mean(values) > figure else "no"


def _curve(progress: list[dict[str, float]]) -> list[list[float | None]]:
    """A run's training curve from its progress rows, as ``[env_steps, return, entropy]``:
    every k-th iteration, k the smallest that keeps at most ``CURVE_POINTS``, counted back
    from the last (always kept); a return with no finished game (NaN) is None."""
    step = math.ceil(len(progress) / CURVE_POINTS)
    kept = progress[len(progress) - 1 :: -step][::-1]
    return [
        [
            int(row["env_steps"]),
            None if math.isnan(row["episode_return_mean"]) else row["episode_return_mean"],
            row["entropy"],
        ]
        for row in kept
    ]


def write_docs(table: str) -> None:
    text = DOC.read_text()
    start, end = (text.index(m) for m in MARKERS)
    DOC.write_text(text[: start + len(MARKERS[0])] + "\n" + table + "\n" + text[end:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-root", type=Path, required=True)
    parser.add_argument("--games", default=",".join(GAMES))
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument(
        "--sticky",
        type=float,
        default=None,
        help="sticky_action_prob to train and evaluate with (default: the "
        "preset's 0.1; 0: gymnax's protocol)",
    )
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    games = [g for g in args.games.split(",") if g]
    unknown = set(games) - set(GAMES)
    if unknown:
        parser.error(f"--games: unknown {sorted(unknown)}; choose from {', '.join(GAMES)}")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    args.run_root.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        for seed in seeds:
            for game in games:
                folder = run_dir(args.run_root, game, seed, args.sticky)
                if (folder / RESULT).exists():
                    done = json.loads((folder / RESULT).read_text())
                    completed = complete(folder, done)
                    if completed is not done:
                        print(f"{game} seed {seed}: evaluated without sticky actions", flush=True)
                        write_result(folder, completed)
                    continue
                print(f"{game} seed {seed} ...", flush=True)
                seconds = train(folder, game, seed, args.sticky)
                finish(folder, game, seed, args.sticky)
                result = json.loads((folder / RESULT).read_text())
                print(
                    f"  deterministic {result['deterministic']['mean_return']:.1f}, "
                    f"stochastic {result['stochastic']['mean_return']:.1f}, "
                    f"{seconds / 60:.1f} min this session",
                    flush=True,
                )
    found = results(args.run_root, RECORD)
    table = report(found)
    print(table)
    if args.write_docs:
        write_docs(table)
        RECORD.write_text(json.dumps(found, indent=1) + "\n")


if __name__ == "__main__":
    main()
