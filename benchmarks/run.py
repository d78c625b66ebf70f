"""Side-by-side benchmark: trustrl against Stable-Baselines3 PPO and sb3-contrib TRPO.

    .venv/bin/python benchmarks/run.py                  # every case, 3 pairs, writes docs/
    .venv/bin/python benchmarks/run.py --cases 1,3 --pairs 5
    .venv/bin/python benchmarks/run.py --quick          # smoke run, tiny budgets

Each run is a fresh subprocess (benchmarks/worker.py). Within a case the two libraries
alternate, trustrl then the peer, pair after pair, each next to the env-only ceiling of
its own env stack (trustrl's just before it, the peer's just after), so slow drift of a
shared machine lands on both sides alike; ratios are taken per pair and summarized by
their median. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import cases  # noqa: E402

PEER_NAMES = {"sb3": "SB3 PPO", "sb3-contrib": "sb3-contrib TRPO"}


# Running one job.


def run_job(job: dict[str, Any], env: dict[str, str], timeout: float) -> dict[str, Any]:
    job = {**job, "spawned_at": time.monotonic()}
    command = [sys.executable, str(HERE / "worker.py"), json.dumps(job)]
    try:
        proc = subprocess.run(
            command, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("BENCH_RESULT "):
            return json.loads(line.removeprefix("BENCH_RESULT "))
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
    return {"error": f"exit {proc.returncode}: " + "\n".join(tail)}


# Provenance.


def git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT, check=True)
        return out.stdout.rstrip()  # not strip(): porcelain lines start with a status column
    except (OSError, subprocess.CalledProcessError):
        return ""


def tree_digest(folder: Path) -> str:
    """sha256 over the package's source files (paths and contents), to name the code
    measured even when it differs from the commit."""
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.suffix in (".py", ".toml") and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(folder)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    """The CPU's model name, family and model, and its widest vector unit: two machines
    of this workplace both call themselves "AMD EPYC" and differ 2x in speed (Zen 5 with
    AVX-512 against an AVX2 one)."""
    try:
        fields: dict[str, str] = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor()
    flags = fields.get("flags", "").split()
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    family = f"family {fields.get('cpu family', '?')}, model {fields.get('model', '?')}"
    return f"{fields.get('model name', platform.processor())} ({family}, {vector})"


def provenance(snapshot: Path | None) -> dict[str, Any]:
    dirty = git("status", "--porcelain", "--", "trustrl")
    return {
        "commit": git("rev-parse", "HEAD"),
        "commit_subject": git("log", "-1", "--format=%s"),
        "trustrl_modified_files": [line[3:] for line in dirty.splitlines()],
        "trustrl_source_sha256": tree_digest(snapshot or ROOT / "trustrl"),
        "trustrl_snapshot": snapshot is not None,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "versions": {
            name: version(name)
            for name in (
                "torch",
                "numpy",
                "gymnasium",
                "mujoco",
                "stable-baselines3",
                "sb3-contrib",
            )
        },
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "loadavg_start": list(os.getloadavg()),
    }


# Summaries.


def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(case_id: int, runs: list[dict[str, Any]], s: dict[str, Any]) -> dict[str, Any]:
    case = cases.CASES[case_id]
    by_side: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_side.setdefault(run["side"], []).append(run)
    pairs = sorted({run["pair"] for run in runs})

    def get(side: str, pair: int, *keys: str) -> Any:
        for run in by_side.get(side, []):
            if run["pair"] == pair and "error" not in run["result"]:
                value: Any = run["result"]
                for key in keys:
                    value = value.get(key) if isinstance(value, dict) else None
                return value
        return None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    out: dict[str, Any] = {"pairs": len(pairs), "errors": []}
    for run in runs:
        if "error" in run["result"]:
            out["errors"].append(f"pair {run['pair']} {run['side']}: {run['result']['error']}")
    for key in ("sps", "peak_rss_mib", "train_time", "env_steps"):
        out[key] = {side: [get(side, p, key) for p in pairs] for side in ("trustrl", "sb3")}
    out["sps_ratio"] = [ratio(get("trustrl", p, "sps"), get("sb3", p, "sps")) for p in pairs]
    out["sps_ratio_median"] = median(out["sps_ratio"])
    out["ceiling_sps"] = [get("ceiling", p, "sps") for p in pairs]
    out["ceiling_env"] = next((get("ceiling", p, "env") for p in pairs), None)
    out["ceiling_sb3_sps"] = [get("ceiling-sb3", p, "sps") for p in pairs]
    if case.get("threshold"):
        times = {
            side: [get(side, p, "threshold", "wall_time") for p in pairs]
            for side in ("trustrl", "sb3")
        }
        steps = {
            side: [get(side, p, "threshold", "env_steps") for p in pairs]
            for side in ("trustrl", "sb3")
        }
        out["threshold_time"] = times
        out["threshold_steps"] = steps
        out["threshold_time_ratio"] = [
            ratio(a, b) for a, b in zip(times["trustrl"], times["sb3"], strict=True)
        ]
        out["threshold_time_ratio_median"] = median(out["threshold_time_ratio"])
    if case.get("time_collection"):
        out["collect_sps"] = {
            side: [get(side, p, "collect_sps") for p in pairs] for side in ("trustrl", "sb3")
        }
        out["collect_sps_ratio"] = [
            ratio(a, b)
            for a, b in zip(out["collect_sps"]["trustrl"], out["collect_sps"]["sb3"], strict=True)
        ]
        out["collect_over_ceiling"] = [
            ratio(get("trustrl", p, "collect_sps"), get("ceiling", p, "sps")) for p in pairs
        ]
        out["collect_over_ceiling_median"] = median(out["collect_over_ceiling"])
    if case.get("time_split"):
        # Seconds per part of the training loop (worker.time_split), per side and pair.
        parts = ("env", "acting", "update", "other")
        out["split"] = {
            side: {part: [get(side, p, "split", part) for p in pairs] for part in parts}
            for side in ("trustrl", "sb3")
        }
        # The peer's seconds over trustrl's, per part and pair (above 1: trustrl faster).
        out["split_ratio"] = {
            part: [
                ratio(get("sb3", p, "split", part), get("trustrl", p, "split", part)) for p in pairs
            ]
            for part in parts
        }
        # trustrl counts NEXT_STEP's reset rows (one per finished episode, here every lost
        # life) as env steps; SB3's DummyVecEnv resets inside the step that ended the
        # episode and counts agent steps only. The same ratio on SB3's count:
        out["reset_row_share"] = [get("trustrl", p, "reset_row_share") for p in pairs]
        out["sps_ratio_agent_steps"] = [
            ratio(
                None if sps is None or share is None else sps * (1.0 - share),
                get("sb3", p, "sps"),
            )
            for p, sps, share in zip(
                pairs, out["sps"]["trustrl"], out["reset_row_share"], strict=True
            )
        ]
        out["sps_ratio_agent_steps_median"] = median(out["sps_ratio_agent_steps"])
        out["policy_params"] = {
            side: next((get(side, p, "policy_params") for p in pairs), None)
            for side in ("trustrl", "sb3")
        }
    if case.get("rollout_memory"):
        out["rollout_memory"] = {
            side: next(
                (
                    get(side, p, "rollout_memory")
                    for p in pairs
                    if get(side, p, "rollout_memory") is not None
                ),
                None,
            )
            for side in ("trustrl", "sb3")
        }
    if case.get("eval_episodes"):
        out["eval_return"] = {
            side: [get(side, p, "eval", "mean_return") for p in pairs]
            for side in ("trustrl", "sb3")
        }
    if case.get("solve"):
        out["solved_process_time"] = [get("trustrl", p, "solved", "process_time") for p in pairs]
        out["solved_env_steps"] = [get("trustrl", p, "solved", "env_steps") for p in pairs]
        out["solved_wall_time"] = [get("trustrl", p, "solved", "wall_time") for p in pairs]
        out["import_time"] = [get("trustrl", p, "import_time") for p in pairs]
    out["checks"] = checks(case_id, out)
    return out


def med_of(summary: dict[str, Any], key: str, side: str) -> float | None:
    return median(summary[key][side])


def checks(case_id: int, m: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each as {target, measured, pass}."""
    result: list[dict[str, Any]] = []

    def add(target: str, measured: str, ok: bool | None) -> None:
        result.append({"target": target, "measured": measured, "pass": ok})

    def at_least(value: float | None, bound: float) -> bool | None:
        return None if value is None else value >= bound

    r = m["sps_ratio_median"]
    if case_id == 1:
        add("SPS >= 4x SB3", fmt_ratio(r), at_least(r, 4.0))
        rss_t, rss_p = med_of(m, "peak_rss_mib", "trustrl"), med_of(m, "peak_rss_mib", "sb3")
        add(
            "peak RSS <= SB3's",
            f"{fmt(rss_t, 1)} vs {fmt(rss_p, 1)} MiB",
            None if rss_t is None or rss_p is None else rss_t <= rss_p,
        )
    elif case_id == 2:
        tr = m["threshold_time_ratio_median"]
        reached = all(t is not None for t in m["threshold_time"]["trustrl"])
        times = m["threshold_time"]
        add(
            "wall time to 475 <= 0.25x SB3",
            fmt_ratio(tr)
            + f" ({fmt(median(times['trustrl']), 1)} s vs {fmt(median(times['sb3']), 1)} s)"
            + ("" if reached else " (trustrl did not always reach 475)"),
            None if tr is None else (tr <= 0.25 and reached),
        )
    elif case_id == 3:
        add("SPS >= 3x SB3", fmt_ratio(r), at_least(r, 3.0))
        ours, theirs = (
            median(m["eval_return"]["trustrl"]),
            median(m["eval_return"]["sb3"]),
        )
        # "Equal": within 10% of the peer's return magnitude (seed noise on Pendulum).
        ok = None if ours is None or theirs is None else ours >= theirs - 0.1 * abs(theirs)
        add(
            "final return >= SB3's (within 10%)",
            f"{fmt(ours, 1)} vs {fmt(theirs, 1)}",
            ok,
        )
    elif case_id == 4:
        add("SPS >= 2x SB3", fmt_ratio(r), at_least(r, 2.0))
        c = m["collect_over_ceiling_median"]
        add(
            "collection SPS >= 70% of env-only ceiling",
            # One decimal: 69.6% printed as "70%" next to FAIL.
            "n/a" if c is None else f"{100 * c:.1f}%",
            at_least(c, 0.70),
        )
    elif case_id == 5:
        add("SPS >= 3x sb3-contrib", fmt_ratio(r), at_least(r, 3.0))
    elif case_id == 9:
        add("in-learn SPS >= 3x RecurrentPPO", fmt_ratio(r), at_least(r, 3.0))
        tr = m["threshold_time_ratio_median"]
        times = m["threshold_time"]
        reached = all(t is not None for t in times["trustrl"] + times["sb3"])
        add(
            "wall time to 475 <= 1/3 of RecurrentPPO's",
            fmt_ratio(tr)
            + f" ({fmt(median(times['trustrl']), 1)} s vs {fmt(median(times['sb3']), 1)} s)"
            + ("" if reached else " (not every run reached 475)"),
            None if tr is None else (tr <= 1 / 3 and reached),
        )
    elif case_id in (7, 8):
        goal = {7: 1.2, 8: 3.0}[case_id]
        add(f"in-learn SPS >= {goal:g}x SB3", fmt_ratio(r), at_least(r, goal))
        a = m["sps_ratio_agent_steps_median"]
        share = median(m["reset_row_share"])
        add(
            f"the same on SB3's count (trustrl's reset rows left out) >= {goal:g}x",
            fmt_ratio(a) + ("" if share is None else f" (reset rows {100 * share:.1f}%)"),
            at_least(a, goal),
        )
    elif case_id == 6:
        sps = med_of(m, "sps", "trustrl")
        add(">= 200,000 SPS", fmt(sps, 0), at_least(sps, 200_000))
        times = m["solved_process_time"]
        t = median(times)
        all_solved = bool(times) and all(x is not None for x in times)
        add(
            "< 3 s from process start to solved",
            f"{fmt(t, 2)} s" + ("" if all_solved else " (not solved in every run)"),
            None if t is None else (t < 3.0 and all_solved),
        )
    return result


# Formatting.


def fmt(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.{digits}f}"


def fmt_ratio(value: float | None) -> str:
    """Two decimals; three below 1, where a time ratio meets its target of 0.25 or not."""
    if value is None:
        return "n/a"
    return f"{value:.3f}x" if value < 1 else f"{value:.2f}x"


def fmt_list(values: list[float | None], digits: int = 2, suffix: str = "") -> str:
    return " ".join("-" if v is None else f"{v:,.{digits}f}{suffix}" for v in values)


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "FAIL")


def main_table(results: dict[int, dict[str, Any]]) -> list[list[str]]:
    header = [
        "case",
        "trustrl SPS",
        "peer",
        "peer SPS",
        "SPS ratio per pair",
        "median ratio",
        "time to threshold s (trustrl / peer)",
        "peak RSS MiB (trustrl / peer)",
        "env-only ceiling SPS",
    ]
    rows = [header]
    for case_id, entry in results.items():
        m = entry["summary"]
        peer = cases.CASES[case_id]["peer"]
        threshold = "-"
        if "threshold_time" in m:
            t = median(m["threshold_time"]["trustrl"])
            p = median(m["threshold_time"]["sb3"])
            n_t = sum(x is not None for x in m["threshold_time"]["trustrl"])
            n_p = sum(x is not None for x in m["threshold_time"]["sb3"])
            threshold = (
                f"{fmt(t, 1) if n_t else 'not reached'} / {fmt(p, 1) if n_p else 'not reached'}"
                f" (ratio {fmt_ratio(m['threshold_time_ratio_median'])})"
            )
        elif "solved_process_time" in m:
            t = median(m["solved_process_time"])
            threshold = (
                f"{fmt(t, 2)} s to solved, from process start" if t is not None else "not solved"
            )
        rows.append(
            [
                f"{case_id}",
                fmt(med_of(m, "sps", "trustrl")),
                cases.CASES[case_id].get("peer_name", PEER_NAMES.get(peer, "-")) if peer else "-",
                fmt(med_of(m, "sps", "sb3")) if peer else "-",
                fmt_list(m["sps_ratio"], 2, "x") if peer else "-",
                fmt_ratio(m["sps_ratio_median"]) if peer else "-",
                threshold,
                f"{fmt(med_of(m, 'peak_rss_mib', 'trustrl'))} / "
                + (fmt(med_of(m, "peak_rss_mib", "sb3")) if peer else "-"),
                fmt(median(m["ceiling_sps"])),
            ]
        )
    return rows


def targets_table(results: dict[int, dict[str, Any]]) -> list[list[str]]:
    rows = [["case", "target", "measured (median over pairs)", "result"]]
    for case_id, entry in results.items():
        for check in entry["summary"]["checks"]:
            rows.append([str(case_id), check["target"], check["measured"], verdict(check["pass"])])
    return rows


def mib(nbytes: float | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2**20:,.1f} MiB"


def split_table(results: dict[int, dict[str, Any]]) -> list[list[str]] | None:
    """The pixel cases' time split (median seconds over pairs, the share of the training
    loop, and the peer's time over trustrl's per part) and rollout memory; None where no
    case has them."""
    header = [
        "case",
        "part",
        "trustrl s (share)",
        "SB3 s (share)",
        "SB3 / trustrl per pair",
        "median",
    ]
    rows = [header]
    for case_id, entry in results.items():
        m = entry["summary"]
        if "split" not in m:
            continue
        totals = {
            side: sum(median(v) or 0.0 for v in m["split"][side].values())
            for side in ("trustrl", "sb3")
        }
        for part in ("env", "acting", "update", "other"):
            cells = []
            for side in ("trustrl", "sb3"):
                t = median(m["split"][side][part])
                share = (
                    f" ({100 * t / totals[side]:.0f}%)" if t is not None and totals[side] else ""
                )
                cells.append(fmt(t, 1) + share)
            per_pair = m["split_ratio"][part]
            rows.append(
                [
                    str(case_id),
                    part,
                    *cells,
                    fmt_list(per_pair, 2, "x"),
                    fmt_ratio(median(per_pair)),
                ]
            )
        memory = m.get("rollout_memory") or {}
        if memory:
            cells = []
            for side, obs_key in (("trustrl", "obs"), ("sb3", "observations")):
                mem = memory.get(side)
                if not mem:
                    cells.append("n/a")
                    continue
                obs = mem["arrays"].get(obs_key, {})
                cells.append(
                    f"{mib(obs.get('bytes'))} {obs.get('dtype', '?')} "
                    f"(all arrays {mib(mem['total_bytes'])})"
                )
            rows.append([str(case_id), "rollout observations", *cells, "", ""])
        params = m.get("policy_params") or {}
        if params:
            rows.append(
                [
                    str(case_id),
                    "policy parameters",
                    fmt(params.get("trustrl")),
                    fmt(params.get("sb3")),
                    "",
                    "",
                ]
            )
    return rows if len(rows) > 1 else None


def details_table(results: dict[int, dict[str, Any]]) -> list[list[str]]:
    rows = [["case", "pair", "side", "env steps", "train s", "SPS", "peak RSS MiB", "other"]]
    for case_id, entry in results.items():
        for run in entry["runs"]:
            r = run["result"]
            if "error" in r:
                rows.append([str(case_id), str(run["pair"]), run["side"], "error", "", "", "", ""])
                continue
            other = []
            if run["side"].startswith("ceiling"):
                other.append(r.get("env", ""))
            if r.get("threshold"):
                th = r["threshold"]
                other.append(f"475 at {th['env_steps']:,} steps, {th['wall_time']:.1f} s")
            elif "threshold" in r:
                other.append("475 not reached")
            if "collect_sps" in r:
                other.append(f"collection {r['collect_sps']:,.0f} SPS")
            if "split" in r:
                sp = r["split"]
                other.append(
                    f"env {sp['env']:.1f} s, acting {sp['acting']:.1f} s, "
                    f"update {sp['update']:.1f} s, other {sp['other']:.1f} s"
                )
            if "reset_row_share" in r:
                other.append(f"reset rows {100 * r['reset_row_share']:.1f}%")
            if "eval" in r:
                other.append(f"eval {r['eval']['mean_return']:.1f}")
            if r.get("solved"):
                sv = r["solved"]
                other.append(
                    f"solved (eval {sv['eval_return']:.1f}) at {sv['env_steps']:,} steps, "
                    f"{sv['process_time']:.2f} s from process start "
                    f"(imports {r['import_time']:.2f} s)"
                )
            elif "solved" in r:
                other.append("not solved")
            rows.append(
                [
                    str(case_id),
                    str(run["pair"]),
                    run["side"],
                    f"{r.get('env_steps', 0):,}",
                    fmt(r.get("train_time", r.get("seconds")), 1),
                    fmt(r.get("sps")),
                    fmt(r.get("peak_rss_mib")),
                    "; ".join(other),
                ]
            )
    return rows


def text_table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows[1:]]
    return "\n".join(lines)


def settings_line(s: dict[str, Any]) -> str:
    keys = [
        "env_id",
        "algo",
        "backend",
        "num_envs",
        "num_steps",
        "total_steps",
        "update_epochs",
        "num_minibatches",
        "learning_rate",
        "anneal_lr",
        "gamma",
        "gae_lambda",
        "clip_coef",
        "anneal_clip",
        "ent_coef",
        "normalize_obs",
        "normalize_reward",
    ]
    if s["algo"] == "trpo":
        keys = [
            k
            for k in keys
            if k
            not in (
                "update_epochs",
                "learning_rate",
                "anneal_lr",
                "clip_coef",
                "anneal_clip",
                "ent_coef",
            )
        ]
        keys += ["max_kl", "cg_iters", "cg_damping", "vf_lr", "train_vf_iters"]
    if s.get("cnn"):
        keys += [
            "cnn",
            "share_encoder",
            "hidden_sizes",
            "activation",
            "env_kwargs",
            "frame_stack",
            "episodic_life",
            "clip_reward",
        ]
    return ", ".join(f"{k}={s[k]}" for k in keys)


def markdown(data: dict[str, Any], results: dict[int, dict[str, Any]]) -> str:
    meta = data["meta"]
    modified = meta["trustrl_modified_files"]
    lines = [
        "# Benchmarks: trustrl vs Stable-Baselines3 / sb3-contrib",
        "",
        "Generated by `benchmarks/run.py` (see `benchmarks/README.md`); the raw numbers are in "
        "the `.json` file of the same name.",
        "",
        f"- commit `{meta['commit']}` ({meta['commit_subject']})"
        + (
            f"; trustrl/ had uncommitted changes in {', '.join(modified)} "
            f"(source sha256 {meta['trustrl_source_sha256']})"
            if modified
            else f" (trustrl source sha256 {meta['trustrl_source_sha256']})"
        ),
        f"- {meta['date']}, {meta['cpu']}, {meta['cpus']} CPUs, load average "
        f"{meta['loadavg_start'][0]:.1f} at start / {meta['loadavg_end'][0]:.1f} at end",
        f"- python {meta['python']}, "
        + ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v),
        f"- {meta['pairs']} pair(s) per case, trustrl then the peer in each pair, each run a "
        f"fresh process; torch.set_num_threads(1) on both sides (SB3's faster setting "
        f"here); trustrl's PPO computes the critic's share of each minibatch step in a "
        f"second process (`ppo.critic_process`), whose private memory is added to its "
        f"peak RSS"
        + ("; QUICK smoke run (tiny budgets, not a measurement)" if meta["quick"] else ""),
        f"- wall time of the whole benchmark: {meta['benchmark_wall_time'] / 60:.1f} min",
        "",
        "## Summary (medians over pairs)",
        "",
        markdown_table(main_table(results)),
        "",
        "## Targets",
        "",
        markdown_table(targets_table(results)),
        "",
    ]
    split = split_table(results)
    if split:
        lines += [
            "## Pixels: where the time goes, rollout memory",
            "",
            "Seconds of the training loop (medians over pairs): env stepping (inside the vector "
            "env's step), acting (the rest of rollout collection), update (trustrl's includes "
            "its GAE, SB3's acting its), other (logging, checkpoints, snapshots); the rollout's "
            "arrays as allocated (trustrl's obs rows are the frames flattened).",
            "",
            markdown_table(split),
            "",
        ]
    lines += [
        "## Settings",
        "",
    ]
    for case_id, entry in results.items():
        lines.append(f"{case_id}. {entry['title']}: {settings_line(entry['settings'])}")
    lines += ["", "## Every run", "", markdown_table(details_table(results)), ""]
    errors = [e for entry in results.values() for e in entry["summary"]["errors"]]
    if errors:
        lines += ["## Errors", "", *[f"- {e}" for e in errors], ""]
    return "\n".join(lines)


# Main.


def parse_cases(text: str) -> list[int]:
    ids = [int(part) for part in text.split(",") if part.strip()]
    unknown = [i for i in ids if i not in cases.CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; cases are {sorted(cases.CASES)}")
    return ids


def snapshot_trustrl() -> Path:
    """Copy trustrl/ so every run measures the same code even while it is being edited."""
    folder = Path(tempfile.mkdtemp(prefix="trustrl-bench-src-"))
    shutil.copytree(
        ROOT / "trustrl", folder / "trustrl", ignore=shutil.ignore_patterns("__pycache__")
    )
    return folder


def write(json_path: Path, data: dict[str, Any], results: dict[int, dict[str, Any]]) -> None:
    """Print the tables; write the JSON to ``json_path`` and the markdown next to it, with
    the same name (``benchmarks.json`` -> ``benchmarks.md``)."""
    print("\n" + text_table(main_table(results)))
    print("\n" + text_table(targets_table(results)))
    split = split_table(results)
    if split:
        print("\n" + text_table(split))
    json_path.parent.mkdir(parents=True, exist_ok=True)
    md_path = json_path.with_suffix(".md")
    json_path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    md_path.write_text(markdown(data, results))
    print(f"\nwrote {json_path} and {md_path}")


def render(path: Path) -> None:
    data = json.loads(path.read_text())
    results = {int(k): v for k, v in data["cases"].items()}
    for case_id, entry in results.items():
        entry["summary"] = summarize(case_id, entry["runs"], entry["settings"])
    data["cases"] = {str(k): v for k, v in results.items()}
    write(path, data, results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=None, help="A/B pairs per case (3; quick: 1)")
    parser.add_argument("--cases", default=",".join(map(str, cases.CASES)), help="e.g. 1,3")
    parser.add_argument("--quick", action="store_true", help="smoke run with tiny budgets")
    parser.add_argument("--seed", type=int, default=1, help="seed of pair 0 (pair i: seed + i)")
    parser.add_argument(
        "--out-dir",
        default=None,
        help="where benchmarks.json/.md go (docs/; quick: runs/benchmarks-quick/)",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument(
        "--live",
        action="store_true",
        help="import trustrl from the working tree for every run instead of a snapshot "
        "taken at start",
    )
    parser.add_argument(
        "--render",
        metavar="JSON",
        help="measure nothing: recompute the summaries of a benchmark JSON and rewrite it "
        "and its markdown next to it (same name, .md)",
    )
    args = parser.parse_args()
    if args.render:
        render(Path(args.render))
        return
    pairs = args.pairs if args.pairs is not None else (1 if args.quick else 3)
    if pairs < 1:
        raise SystemExit("--pairs must be >= 1")
    case_ids = parse_cases(args.cases)
    out_dir = Path(args.out_dir or (ROOT / ("runs/benchmarks-quick" if args.quick else "docs")))

    snapshot = None if args.live else snapshot_trustrl()
    env = dict(os.environ)
    if snapshot is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(snapshot), env.get("PYTHONPATH", "")) if p
        )
    meta = provenance(snapshot)
    meta.update(pairs=pairs, quick=args.quick, cases=case_ids, seed=args.seed)
    started = time.monotonic()
    print(
        f"trustrl benchmark: commit {meta['commit'][:10]}"
        + (" (trustrl/ modified)" if meta["trustrl_modified_files"] else "")
        + f", cases {case_ids}, {pairs} pair(s){', quick' if args.quick else ''}",
        flush=True,
    )

    results: dict[int, dict[str, Any]] = {}
    try:
        for case_id in case_ids:
            case = cases.CASES[case_id]
            s = cases.settings(case_id, args.quick)
            print(f"\ncase {case_id}: {case['title']}", flush=True)
            runs: list[dict[str, Any]] = []
            # Each library's run next to the ceiling of its own env stack, so the
            # collection / ceiling ratio spans minutes of drift, not a whole pair.
            sides = ["ceiling", "trustrl"] + (["sb3", "ceiling-sb3"] if case["peer"] else [])
            for pair in range(pairs):
                for side in sides:
                    job = {
                        "case": case_id,
                        "side": side,
                        "seed": args.seed + pair,
                        "quick": args.quick,
                    }
                    result = run_job(job, env, args.timeout)
                    runs.append({"pair": pair, "side": side, "result": result})
                    if "error" in result:
                        print(f"  pair {pair} {side:12s} ERROR {result['error']}", flush=True)
                    else:
                        extra = ""
                        if result.get("threshold"):
                            extra = f", 475 after {result['threshold']['wall_time']:.1f} s"
                        if result.get("solved"):
                            extra = f", solved {result['solved']['process_time']:.2f} s"
                        if result.get("split"):
                            sp = result["split"]
                            extra = (
                                f", env {sp['env']:.1f} s, acting {sp['acting']:.1f} s, "
                                f"update {sp['update']:.1f} s"
                            )
                        print(
                            f"  pair {pair} {side:12s} {result['sps']:>12,.0f} SPS"
                            f"  {result['peak_rss_mib']:7.0f} MiB{extra}",
                            flush=True,
                        )
            entry = {
                "title": case["title"],
                "peer": case["peer"],
                "settings": {k: list(v) if isinstance(v, tuple) else v for k, v in s.items()},
                "trustrl_config": {
                    k: v for k, v in cases.trustrl_table(s, args.seed, "<tmp>").items()
                },
                "runs": runs,
            }
            if case["peer"]:
                entry["sb3_setup"] = cases.describe_sb3(cases.sb3_setup(s, args.seed))
            entry["summary"] = summarize(case_id, runs, s)
            results[case_id] = entry
    finally:
        if snapshot is not None:
            shutil.rmtree(snapshot, ignore_errors=True)

    meta["loadavg_end"] = list(os.getloadavg())
    meta["benchmark_wall_time"] = time.monotonic() - started
    data = {"meta": meta, "cases": {str(k): v for k, v in results.items()}}

    write(out_dir / "benchmarks.json", data, results)


if __name__ == "__main__":
    main()
