"""One benchmark run in a fresh process; prints one JSON line ``BENCH_RESULT {...}``.

    python benchmarks/worker.py '{"case": 1, "side": "trustrl", "seed": 1, "quick": false}'

side is "trustrl", "sb3" (Stable-Baselines3 PPO or sb3-contrib TRPO, as the case's
algo says) or "ceiling" / "ceiling-sb3" (random actions through trustrl's vector env /
through the SB3 env stack, no learning). Each side imports only its own library, so
the peak resident memory (ru_maxrss, read at the end) is that library's.
"""

from __future__ import annotations

import time

PROCESS_START = time.monotonic()  # before any heavy import: case 6 measures from here

import json  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The repository's examples (case 9's env, examples/masked.py); appended, so that the
# trustrl measured is still the one PYTHONPATH names.
sys.path.append(str(Path(__file__).resolve().parent.parent))
import cases  # noqa: E402

# The env-only ceiling steps as many env steps as the case trains (a 2-second window swung
# from 2,896 to 4,329 SPS between the pairs of one Hopper run), within these bounds.
CEILING_MIN_SECONDS = 2.0
CEILING_MAX_SECONDS = 30.0


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def private_mib(pid: int) -> float:
    """Memory only process ``pid`` holds (private pages; the pages it shares with other
    processes, shared libraries and the shared-memory segments, are in their RSS)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        fields = {line.split(":")[0]: int(line.split()[1]) for line in f if line.endswith("kB\n")}
    return (fields["Private_Clean"] + fields["Private_Dirty"]) / 1024.0


def count_workers(trainer: Any, out: dict[str, float]) -> None:
    """Wrap each update's ``close`` (instance attribute, benchmark-only) to read the private
    memory of its critic worker process (trustrl/learner/updates/critic_worker.py) before
    it stops; the largest lands in ``out["worker_private_mib"]`` and counts toward peak memory."""
    for update in trainer.updates:
        original = getattr(update, "close", None)
        if original is None:  # a checkout from before the worker (PYTHONPATH)
            continue

        def close(update: Any = update, original: Any = original) -> None:
            worker = getattr(getattr(update, "gradients", None), "worker", None)
            if worker is not None:
                mib = private_mib(worker.pid)
                out["worker_private_mib"] = max(out.get("worker_private_mib", 0.0), mib)
            original()

        update.close = close


class RecentReturns:
    """Finished training episodes and the first time the mean of the last ``window``
    reaches ``target`` (checked at the end of each rollout collection)."""

    def __init__(self, threshold: dict[str, Any] | None, start: float) -> None:
        self.threshold = threshold
        self.start = start
        self.returns: list[float] = []
        self.reached_at: dict[str, float] | None = None

    def end_of_rollout(self, env_steps: int) -> bool:
        """True when the threshold was reached just now."""
        if self.threshold is None or self.reached_at is not None:
            return False
        window = self.returns[-self.threshold["window"] :]
        if len(window) == self.threshold["window"] and (
            sum(window) / len(window) >= self.threshold["return"]
        ):
            self.reached_at = {
                "wall_time": time.monotonic() - self.start,
                "env_steps": env_steps,
                "process_time": time.monotonic() - PROCESS_START,
            }
            return True
        return False


def run_summary(
    case: dict[str, Any],
    env_steps: int,
    clocks: tuple[float, float, float, float],
    timing: dict[str, Any],
    recent: RecentReturns,
) -> dict[str, Any]:
    """The fields both libraries' runs report. ``clocks``: monotonic times when the imports
    were done, building started, training started and training ended."""
    imported, build_start, train_start, train_end = clocks
    out: dict[str, Any] = {
        "env_steps": env_steps,
        "train_time": train_end - train_start,
        "build_time": train_start - build_start,
        "import_time": imported - PROCESS_START,
        "sps": env_steps / (train_end - train_start),
        "iterations": timing["iterations"],
    }
    if case.get("threshold"):
        out["threshold"] = recent.reached_at
    if case.get("time_collection") and timing["collect_time"] > 0:
        out["collect_time"] = timing["collect_time"]
        out["collect_sps"] = env_steps / timing["collect_time"]
    if case.get("time_split"):
        out["split"] = time_split(out["train_time"], timing)
    return out


def time_split(train_time: float, timing: dict[str, Any]) -> dict[str, float]:
    """The training loop's time in seconds: env stepping (inside the vector env's ``step``),
    acting (the rest of rollout collection: the policy's forward pass, sampling, storing
    the rows, and for SB3 its GAE sweep), update (for trustrl its GAE too) and other (the
    rest of the loop: logging, checkpoints, snapshots)."""
    collect, env = timing["collect_time"], timing["env_time"]
    update = timing["update_time"]
    return {
        "env": env,
        "acting": collect - env,
        "update": update,
        "other": train_time - collect - update,
        "collect": collect,
        "env_calls": timing["env_calls"],
    }


def timed(method: Any, timing: dict[str, Any], key: str, calls: str | None = None) -> Any:
    """``method`` wrapped to add its wall time to ``timing[key]`` (and count its calls)."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            timing[key] += time.perf_counter() - t
            if calls is not None:
                timing[calls] += 1

    return wrapper


def array_bytes(arrays: dict[str, Any]) -> dict[str, Any]:
    """Each numpy array's bytes, dtype and shape, and their total, from ``name: value``
    (values that are not arrays are left out)."""
    import numpy as np

    entries = {
        name: {"bytes": int(a.nbytes), "dtype": str(a.dtype), "shape": list(a.shape)}
        for name, a in arrays.items()
        if isinstance(a, np.ndarray)
    }
    return {"arrays": entries, "total_bytes": sum(e["bytes"] for e in entries.values())}


def parameter_count(module: Any) -> int:
    return sum(p.numel() for p in module.parameters())


def deterministic_eval(act: Any, env_id: str, episodes: int, seed: int) -> dict[str, Any]:
    """Mean return over seeded episodes (seed + 1_000_000 + i: trustrl's own scheme)."""
    import gymnasium as gym

    env = gym.make(env_id)
    returns = []
    for i in range(episodes):
        obs, _ = env.reset(seed=seed + 1_000_000 + i)
        total, done = 0.0, False
        while not done:
            obs, reward, terminated, truncated, _ = env.step(act(obs))
            total += float(reward)
            done = bool(terminated or truncated)
        returns.append(total)
    env.close()
    return {"mean_return": sum(returns) / len(returns), "returns": returns}


# trustrl.


def run_trustrl(job: dict[str, Any]) -> dict[str, Any]:
    case = cases.CASES[job["case"]]
    s = cases.settings(job["case"], job["quick"])
    seed = job["seed"]
    run_dir = tempfile.mkdtemp(prefix="trustrl-bench-")
    try:
        import trustrl
        from trustrl.config import config_from_dict

        Trainer = trustrl.Trainer  # trustrl imports torch lazily: do it before the clock

        table = cases.trustrl_table(s, seed, run_dir)
        solve = case.get("solve")
        if solve:
            table["eval_episodes"] = solve["episodes"]
            table["target_return"] = solve["return"]
        config = config_from_dict(table)
        imported = time.monotonic()

        build_start = time.monotonic()
        trainer = Trainer(config)
        recent = RecentReturns(case.get("threshold"), build_start)
        timing: dict[str, Any] = {
            "collect_time": 0.0,
            "collect_steps": 0,
            "iterations": 0,
            "env_time": 0.0,
            "env_calls": 0,
            "update_time": 0.0,
            "rows": 0,
            "valid_rows": 0,
        }
        original_collect = trainer.collector.collect
        memory: dict[str, Any] = {}

        class Reached(Exception):
            pass

        steps_per_collect = config.env.num_envs * config.rollout.num_steps

        def collect(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            stats = original_collect(*args, **kwargs)
            timing["collect_time"] += time.perf_counter() - t
            timing["collect_steps"] += steps_per_collect
            timing["iterations"] += 1
            for group in stats.groups:  # reset rows (NEXT_STEP autoreset) are not valid
                timing["rows"] += int(group.valid.size)
                timing["valid_rows"] += int(group.valid.sum())
            if case.get("rollout_memory") and not memory:
                # The rollout as the collector hands it over; the learner's Rollout wraps
                # these arrays without a copy (learner/rollout.py, Rollout.from_batch).
                memory.update(array_bytes(vars(stats.groups[0])))
            recent.returns.extend(stats.episodes.returns)  # a RolloutBatch
            if recent.end_of_rollout(timing["collect_steps"]):
                raise Reached
            return stats

        trainer.collector.collect = collect  # instance attribute: benchmark-only wrapping

        solved: dict[str, Any] = {}
        if solve:
            original_evaluate = trainer.evaluate

            def evaluate(*args: Any, **kwargs: Any) -> Any:
                result = original_evaluate(*args, **kwargs)
                if not solved and result.mean_return >= solve["return"]:
                    now = time.monotonic()
                    solved.update(
                        process_time=now - PROCESS_START,
                        wall_time=now - build_start,
                        env_steps=timing["collect_steps"],
                        eval_return=result.mean_return,
                    )
                return result

            trainer.evaluate = evaluate

        if case.get("time_split"):
            # Env stepping: the Gymnasium vector env's step (the collector's rows call it);
            # update: the trainer's _update (GAE and the PPO epochs). Instance attributes.
            envs = trainer.collector.envs
            envs.step = timed(envs.step, timing, "env_time", "env_calls")
            trainer._update = timed(trainer._update, timing, "update_time")  # type: ignore[method-assign]

        workers: dict[str, float] = {}
        count_workers(trainer, workers)

        train_start = time.monotonic()
        stopped_early = False
        try:
            trainer.train()
        except Reached:
            stopped_early = True
        train_end = time.monotonic()
        # The trainer's own count if the wrapper was bypassed (a changed collector API).
        env_steps = timing["collect_steps"] or int(getattr(trainer, "env_steps", 0))

        out = run_summary(
            case, env_steps, (imported, build_start, train_start, train_end), timing, recent
        )
        out.update(workers)
        out.update(
            stopped_early=stopped_early,
            collect_wrapped=timing["iterations"] > 0,
            trustrl_module=trustrl.__file__,
        )
        if case.get("time_split"):
            out["reset_row_share"] = 1.0 - timing["valid_rows"] / max(timing["rows"], 1)
            out["policy_params"] = parameter_count(trainer.policy)
            out["encoders"] = [
                m.describe() for m in trainer.policy.modules() if type(m).__name__ == "ConvEncoder"
            ]
        if memory:
            out["rollout_memory"] = memory
        if case.get("eval_episodes"):
            policy = trainer.policy
            out["eval"] = deterministic_eval(
                lambda obs: policy.act(obs, deterministic=True),
                s["env_id"],
                case["eval_episodes"],
                seed,
            )
        if solve:
            out["solved"] = solved or None
            out["process_time_total"] = train_end - PROCESS_START
        return out
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


# Stable-Baselines3 / sb3-contrib.


def sb3_vec_env(s: dict[str, Any], setup: dict[str, Any], seed: int) -> Any:
    """The SB3 side's env stack, as ``model.learn`` steps it: ``make_vec_env`` (DummyVecEnv,
    Monitor per env), for ALE ids ``make_atari_env`` (AtariWrapper) and VecFrameStack;
    VecTransposeImage where SB3 would add it itself (channels-last uint8 frames);
    VecNormalize where the case normalizes."""
    import gymnasium as gym
    from stable_baselines3.common.env_util import make_atari_env, make_vec_env
    from stable_baselines3.common.preprocessing import (
        is_image_space,
        is_image_space_channels_first,
    )
    from stable_baselines3.common.vec_env import (
        DummyVecEnv,
        VecFrameStack,
        VecNormalize,
        VecTransposeImage,
    )

    env_id = s["env_id"]
    if env_id.startswith("ALE/"):
        import ale_py

        gym.register_envs(ale_py)
    elif env_id.startswith("MinAtar/") and env_id not in gym.registry:
        from minatar.gym import register_envs

        register_envs()
    spec = setup.get("env") or {"atari": False, "env_kwargs": {}}
    if spec["atari"]:
        env = make_atari_env(
            env_id,
            n_envs=s["num_envs"],
            seed=seed,
            vec_env_cls=DummyVecEnv,
            env_kwargs=spec["env_kwargs"],
            wrapper_kwargs=spec["wrapper_kwargs"],
        )
        env = VecFrameStack(env, n_stack=spec["frame_stack"])
    else:
        if ":" in env_id:  # package.module:callable, as trustrl takes it (examples/masked.py)
            import importlib

            module, _, name = env_id.partition(":")
            env_id = getattr(importlib.import_module(module), name)
        env = make_vec_env(
            env_id,
            n_envs=s["num_envs"],
            seed=seed,
            vec_env_cls=DummyVecEnv,
            env_kwargs=spec["env_kwargs"] or None,
        )
    space = env.observation_space
    if is_image_space(space) and not is_image_space_channels_first(space):
        env = VecTransposeImage(env)  # what PPO's _wrap_env would add
    if setup["vec_normalize"]:
        env = VecNormalize(env, **setup["vec_normalize"])
    return env


def sb3_extractors() -> dict[str, Any]:
    """Custom SB3 features extractors by the name ``cases.sb3_setup`` gives them."""
    import torch
    from stable_baselines3.common.torch_layers import BaseFeaturesExtractor
    from torch import nn

    class MinAtarCNN(BaseFeaturesExtractor):  # type: ignore[misc]
        """trustrl's default encoder for grids under 36 cells a side (MinAtar's network,
        trustrl/acting/conv.py MINATAR_LAYERS, learner/cnn.py ConvEncoder): one conv of 16
        3x3 filters, stride 1, no padding, ReLU, then a linear layer to ``features_dim``
        units, ReLU. Takes (B, H, W, C) grids channels last (MinAtar's), already cast to
        float by SB3's preprocess_obs (bool grids: no scaling, normalize_images=False);
        SB3's ortho_init gives both layers orthogonal weights with gain sqrt(2) and zero
        biases, as ConvEncoder does."""

        def __init__(self, observation_space: Any, features_dim: int = 128) -> None:
            super().__init__(observation_space, features_dim)
            height, width, channels = observation_space.shape
            self.conv = nn.Conv2d(channels, 16, kernel_size=3, stride=1)
            self.linear = nn.Linear(16 * (height - 2) * (width - 2), features_dim)

        def forward(self, observations: torch.Tensor) -> torch.Tensor:
            x = observations.float().permute(0, 3, 1, 2)
            x = torch.relu(self.conv(x))
            return torch.relu(self.linear(x.flatten(1)))

    return {"minatar": MinAtarCNN}


def sb3_rollout_memory(buffer: Any) -> dict[str, Any]:
    """The RolloutBuffer's arrays (as allocated by its reset; ``get`` flattens them in
    place during the update)."""
    names = (
        "observations",
        "actions",
        "rewards",
        "returns",
        "episode_starts",
        "values",
        "log_probs",
        "advantages",
    )
    return array_bytes({name: getattr(buffer, name, None) for name in names})


def run_sb3(job: dict[str, Any]) -> dict[str, Any]:
    case = cases.CASES[job["case"]]
    s = cases.settings(job["case"], job["quick"])
    seed = job["seed"]
    setup = cases.sb3_setup(s, seed)

    import torch
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.vec_env import VecNormalize

    Algo: Any
    if setup["algo"] == "PPO":  # sb3-contrib only where it is the peer (peak RSS)
        from stable_baselines3 import PPO as Algo
    elif setup["algo"] == "RecurrentPPO":
        from sb3_contrib import RecurrentPPO as Algo
    else:
        from sb3_contrib import TRPO as Algo

    # trustrl runs on one torch thread by default (config.torch_threads = 1); same here.
    torch.set_num_threads(1)
    imported = time.monotonic()

    kwargs = dict(setup["kwargs"])
    policy_kwargs = dict(kwargs.pop("policy_kwargs"))
    policy_kwargs["activation_fn"] = {"tanh": torch.nn.Tanh, "relu": torch.nn.ReLU}[
        policy_kwargs["activation_fn"]
    ]
    if "features_extractor_class" in policy_kwargs:
        extractor = policy_kwargs["features_extractor_class"]
        policy_kwargs["features_extractor_class"] = sb3_extractors()[extractor]
    if s["backend"] != "sync":
        raise ValueError(f"the SB3 side runs DummyVecEnv (sync) only, not {s['backend']}")

    build_start = time.monotonic()
    env = sb3_vec_env(s, setup, seed)
    model = Algo(setup.get("policy", "MlpPolicy"), env, policy_kwargs=policy_kwargs, **kwargs)

    recent = RecentReturns(case.get("threshold"), build_start)
    timing = {
        "collect_time": 0.0,
        "iterations": 0,
        "env_time": 0.0,
        "env_calls": 0,
        "update_time": 0.0,
    }

    class Episodes(BaseCallback):
        """Reads Monitor's episode entries; stops training once the threshold is met."""

        def __init__(self) -> None:
            super().__init__()
            self.stop = False

        def _on_step(self) -> bool:
            for info in self.locals["infos"]:
                if "episode" in info:
                    recent.returns.append(float(info["episode"]["r"]))
            return not self.stop

        def _on_rollout_end(self) -> None:
            if recent.end_of_rollout(self.model.num_timesteps):
                self.stop = True

    original_collect = model.collect_rollouts

    def collect_rollouts(*args: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        result = original_collect(*args, **kw)
        timing["collect_time"] += time.perf_counter() - t
        timing["iterations"] += 1
        return result

    # An instance attribute: benchmark-only wrapping.
    model.collect_rollouts = collect_rollouts  # type: ignore[method-assign]
    if case.get("time_split"):
        # Env stepping: the outermost VecEnv's step (step_async + step_wait: DummyVecEnv,
        # Monitor, the wrappers, frame stacking and transposition), which collect_rollouts
        # calls; update: train().
        model.env.step = timed(model.env.step, timing, "env_time", "env_calls")
        model.train = timed(model.train, timing, "update_time")  # type: ignore[method-assign]

    train_start = time.monotonic()
    model.learn(total_timesteps=s["total_steps"], callback=Episodes())
    train_end = time.monotonic()
    env_steps = int(model.num_timesteps)
    out = run_summary(
        case, env_steps, (imported, build_start, train_start, train_end), timing, recent
    )
    out["stopped_early"] = recent.reached_at is not None and env_steps < s["total_steps"]
    if case.get("time_split"):
        out["policy_params"] = parameter_count(model.policy)
        out["policy"] = setup.get("policy")
    if case.get("rollout_memory"):
        out["rollout_memory"] = sb3_rollout_memory(model.rollout_buffer)
    if case.get("eval_episodes"):
        import numpy as np

        vec_normalize = env if isinstance(env, VecNormalize) else None

        def act(obs: Any) -> Any:
            if vec_normalize is not None:
                obs = vec_normalize.normalize_obs(obs)
            action, _ = model.predict(np.asarray(obs), deterministic=True)
            return action

        out["eval"] = deterministic_eval(act, s["env_id"], case["eval_episodes"], seed)
    env.close()
    return out


# The env-only ceiling.


def _time_steps(step: Any, actions: list[Any], num_envs: int, target_steps: int) -> dict[str, Any]:
    """Steps ``target_steps`` env steps (kept within CEILING_MIN/MAX_SECONDS) -> SPS."""
    for i in range(20):  # warm-up
        step(actions[i % len(actions)])
    steps, i = 0, 0
    start = time.perf_counter()
    while True:
        for _ in range(50):
            step(actions[i % len(actions)])
            i += 1
        steps += 50 * num_envs
        elapsed = time.perf_counter() - start
        if elapsed >= CEILING_MAX_SECONDS or (
            elapsed >= CEILING_MIN_SECONDS and steps >= target_steps
        ):
            break
    return {"env_steps": steps, "seconds": elapsed, "sps": steps / elapsed}


def run_ceiling(job: dict[str, Any]) -> dict[str, Any]:
    """Random actions (precomputed batches) through trustrl's own vector env."""
    s = cases.settings(job["case"], job["quick"])
    from trustrl.envs.gym import make_vec_env

    envs = make_vec_env(
        s["env_id"],
        s["num_envs"],
        s["backend"],
        s["env_kwargs"],
        frame_stack=s["frame_stack"],
        episodic_life=s["episodic_life"],
    )
    envs.reset(seed=job["seed"])
    envs.action_space.seed(job["seed"])
    actions = [envs.action_space.sample() for _ in range(1000)]
    out = _time_steps(envs.step, actions, s["num_envs"], s["total_steps"])
    out["env"] = type(envs).__name__
    envs.close()
    return out


def run_ceiling_sb3(job: dict[str, Any]) -> dict[str, Any]:
    """Random actions through the SB3 side's env stack (DummyVecEnv, Monitor, VecNormalize;
    for ALE ids AtariWrapper, VecFrameStack and VecTransposeImage)."""
    s = cases.settings(job["case"], job["quick"])
    setup = cases.sb3_setup(s, job["seed"])
    env = sb3_vec_env(s, setup, job["seed"])
    env.reset()
    import numpy as np

    space = env.action_space
    space.seed(job["seed"])
    actions = [np.stack([space.sample() for _ in range(s["num_envs"])]) for _ in range(1000)]

    def step(action: Any) -> Any:
        return env.step(action)

    out = _time_steps(step, actions, s["num_envs"], s["total_steps"])
    out["env"] = "+".join(_vec_env_names(env))
    env.close()
    return out


def _vec_env_names(env: Any) -> list[str]:
    """The VecEnv stack, innermost first (DummyVecEnv+VecFrameStack+VecTransposeImage)."""
    names = []
    while env is not None:
        names.append(type(env).__name__)
        env = getattr(env, "venv", None)
    return names[::-1]


SIDES = {
    "trustrl": run_trustrl,
    "sb3": run_sb3,
    "ceiling": run_ceiling,
    "ceiling-sb3": run_ceiling_sb3,
}


def main() -> None:
    job = json.loads(sys.argv[1])
    result = SIDES[job["side"]](job)
    # This process's peak, plus what a critic worker process held on its own.
    result["process_peak_rss_mib"] = peak_rss_mib()
    result["peak_rss_mib"] = result["process_peak_rss_mib"] + result.get("worker_private_mib", 0.0)
    result["process_wall"] = time.monotonic() - PROCESS_START
    if job.get("spawned_at") is not None:
        # Interpreter start-up before this file's first line, seen from the runner.
        result["startup_time"] = PROCESS_START - job["spawned_at"]
    print("BENCH_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
