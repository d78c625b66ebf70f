"""The benchmark cases: one settings dict per case, and the two translations of it.

A case's ``settings`` are written once, in trustrl's vocabulary, and
``trustrl_table`` / ``sb3_setup`` turn them into each library's own arguments, so
the two sides cannot drift apart. This module imports nothing heavy: the runner
reads it without torch, and each worker imports only the library it measures.
"""

from __future__ import annotations

import copy
from typing import Any

# Case 6 is trustrl alone, tuned for speed on the numpy-vectorized CartPole. Change
# these freely (the benchmark reports whatever they give); they must still solve
# CartPole-v1 (deterministic evaluation >= 475 over 10 episodes).
CASE6_SETTINGS: dict[str, Any] = {
    "env_id": "CartPole-v1",
    "algo": "ppo",
    "backend": "vector",
    "num_envs": 128,
    "num_steps": 32,
    "total_steps": 1_000_000,  # a budget: the run stops at the first solved evaluation
    "gamma": 0.99,
    "gae_lambda": 0.95,
    # A 32x32 network and 2 epochs at a larger step size: with the update in numpy
    # (trustrl/learner/updates/grads.py) a 1024-row minibatch step is bound by its arithmetic,
    # which these settings cut 4x against 64x64 and 4 epochs at 2.5e-3 (118k SPS,
    # 2.9-3.5 s to solved). Seeds 1-8 (one sitting): 228k-245k SPS, solved 1.8-2.9 s
    # from process start, one seed (5) at 3.8 s (651k env steps).
    "hidden_sizes": [32, 32],
    "learning_rate": 4e-3,
    "anneal_lr": False,
    "clip_coef": 0.2,
    "anneal_clip": False,
    "update_epochs": 2,
    "num_minibatches": 4,
    "ent_coef": 0.0,
    # One thread: two measured slower here (87k against 92k SPS, and 3.4 s against
    # 2.5-2.8 s to solved on seed 1, interleaved).
    "torch_threads": 1,
}

# Everything a case does not say (the usual PPO/TRPO defaults, the same on both sides).
DEFAULTS: dict[str, Any] = {
    "algo": "ppo",
    "backend": "sync",
    "gamma": 0.99,
    "gae_lambda": 0.95,
    "learning_rate": 2.5e-4,
    "anneal_lr": False,
    "clip_coef": 0.2,
    "anneal_clip": False,
    "update_epochs": 10,
    "num_minibatches": 4,
    "ent_coef": 0.0,
    "vf_coef": 0.5,
    "max_grad_norm": 0.5,
    "hidden_sizes": (64, 64),
    "activation": "tanh",
    "ortho_init": True,
    "normalize_obs": False,
    "normalize_reward": False,
    "obs_clip": 10.0,
    "reward_clip": 10.0,
    # Pixels (cases 7 and 8). env_kwargs go to gym.make on both sides; the Atari stack's
    # frame stack, episodic life and reward clipping are trustrl's env.frame_stack,
    # env.episodic_life and env.clip_reward, and SB3's VecFrameStack and AtariWrapper's
    # terminal_on_life_loss and clip_reward. "cnn" names the image encoder both sides
    # use (None: no images): "nature" (SB3's NatureCNN, trustrl's default for frames of
    # 36 px and more) or "minatar" (16 3x3 filters and 128 units, trustrl's default for
    # smaller grids; SB3 gets it as a custom features extractor, benchmarks/worker.py).
    "env_kwargs": {},
    "frame_stack": 0,
    "episodic_life": True,
    "clip_reward": False,
    "share_encoder": False,
    "cnn": None,
    # Memory (case 9): "lstm" is sb3-contrib's RecurrentPPO with an LSTM of memory_size
    # units for the actor and the critic each (enable_critic_lstm), trained on sequences of
    # the whole rollout per env; trustrl's policy.memory = "lstm", sequence_length =
    # num_steps. Both in RecurrentPPO's order: the LSTM on the observation, then the
    # hidden_sizes layers (its net_arch; trustrl's policy.post_memory_sizes).
    "memory": "none",
    "memory_size": 64,
    # trustrl only (SB3's worker sets torch.set_num_threads(1) itself).
    "torch_threads": 1,
    # TRPO only.
    "max_kl": 0.01,
    "cg_iters": 10,
    "cg_damping": 0.1,
    "line_search_steps": 10,
    "line_search_shrink": 0.8,
    "vf_lr": 1e-3,
    "train_vf_iters": 5,
}

# The PPO settings of the pixel cases (7, 8): CleanRL's ppo_atari / the zoo's Atari PPO, but
# for annealing (none here, on both sides) and value clipping (none, as in every case):
# 8 envs x 128 steps, 4 epochs of 4 minibatches (256 rows). The CNN is shared by actor and
# critic on both sides (SB3's CnnPolicy default, trustrl's policy.share_encoder), the
# heads read its ReLU features directly (no hidden layers).
PIXEL_PPO: dict[str, Any] = {
    "num_envs": 8,
    "num_steps": 128,
    "update_epochs": 4,
    "num_minibatches": 4,
    "learning_rate": 2.5e-4,
    "gamma": 0.99,
    "gae_lambda": 0.95,
    "clip_coef": 0.1,
    "ent_coef": 0.01,
    "vf_coef": 0.5,
    "max_grad_norm": 0.5,
    "hidden_sizes": [],
    "activation": "relu",
    "share_encoder": True,
    "total_steps": 100_000,
}

CASES: dict[int, dict[str, Any]] = {
    1: {
        "title": "PPO CartPole-v1, 4 sync envs, 100k steps",
        "peer": "sb3",
        "settings": {
            "env_id": "CartPole-v1",
            "num_envs": 4,
            "num_steps": 128,
            "update_epochs": 4,
            "num_minibatches": 4,
            "learning_rate": 2.5e-4,
            "gamma": 0.99,
            "gae_lambda": 0.95,
            "clip_coef": 0.2,
            "ent_coef": 0.01,
            "vf_coef": 0.5,
            "max_grad_norm": 0.5,
            "total_steps": 100_000,
        },
        "quick_steps": 2_048,
    },
    2: {
        "title": "PPO CartPole-v1 (trustrl preset), time until the last-20-episode mean >= 475",
        "peer": "sb3",
        "settings": {
            "env_id": "CartPole-v1",
            "num_envs": 8,
            "num_steps": 32,
            "update_epochs": 20,
            "num_minibatches": 1,
            "learning_rate": 1e-3,
            "anneal_lr": True,
            "gamma": 0.98,
            "gae_lambda": 0.8,
            "clip_coef": 0.2,
            "anneal_clip": True,
            "ent_coef": 0.0,
            "total_steps": 100_000,
        },
        # Running mean of the last `window` finished training episodes, checked at the
        # end of each rollout collection on both sides; the run stops once reached.
        "threshold": {"window": 20, "return": 475.0},
        "quick_steps": 2_560,
    },
    3: {
        "title": "PPO Pendulum-v1, 4 sync envs, 1024 steps, 64 minibatches, 100k steps",
        "peer": "sb3",
        "settings": {
            "env_id": "Pendulum-v1",
            "num_envs": 4,
            "num_steps": 1024,
            "update_epochs": 10,
            # rl-zoo's batch_size 64: 4 x 1024 / 64 = 64 minibatches.
            "num_minibatches": 64,
            "learning_rate": 1e-3,
            "gamma": 0.9,
            "gae_lambda": 0.95,
            "clip_coef": 0.2,
            "ent_coef": 0.0,
            "total_steps": 100_000,
        },
        # The final return: a deterministic evaluation of each trained policy on these many
        # seeded episodes (the same seeds for both libraries). Pendulum's returns have a
        # heavy tail (a failed swing-up scores -500 to -800 against -100 to -250), so 10
        # episodes let one episode move a run's mean by 50.
        "eval_episodes": 50,
        "quick_steps": 8_192,
    },
    4: {
        "title": "PPO Hopper-v5, 1 env, 2048 steps, batch 64, obs+reward normalization, 50k steps",
        "peer": "sb3",
        "settings": {
            "env_id": "Hopper-v5",
            "num_envs": 1,
            "num_steps": 2048,
            "update_epochs": 10,
            "num_minibatches": 32,
            "learning_rate": 3e-4,
            "gamma": 0.99,
            "gae_lambda": 0.95,
            "clip_coef": 0.2,
            "ent_coef": 0.0,
            "normalize_obs": True,
            "normalize_reward": True,
            "total_steps": 50_000,
        },
        "time_collection": True,
        "quick_steps": 4_096,
    },
    5: {
        "title": "TRPO CartPole-v1, 2 sync envs, 512 steps, 100k steps",
        "peer": "sb3-contrib",
        "settings": {
            "env_id": "CartPole-v1",
            "algo": "trpo",
            "num_envs": 2,
            "num_steps": 512,
            "gamma": 0.99,
            "gae_lambda": 0.98,
            "vf_lr": 1e-3,
            "train_vf_iters": 20,
            # Critic minibatch 2 x 512 / 8 = 128 = sb3-contrib's batch_size.
            "num_minibatches": 8,
            "cg_damping": 1e-3,
            "cg_iters": 10,
            "max_kl": 0.01,
            "total_steps": 100_000,
        },
        "quick_steps": 4_096,
    },
    6: {
        "title": "trustrl alone at its best: PPO CartPole-v1 on the numpy-vectorized env",
        "peer": None,
        "settings": CASE6_SETTINGS,
        "solve": {"return": 475.0, "episodes": 10},
        "quick_steps": 65_536,
    },
    7: {
        "title": "PPO ALE/Breakout-v5 (Nature CNN, shared), 8 sync envs x 128, 100k steps",
        "peer": "sb3",
        "settings": {
            **PIXEL_PPO,
            "env_id": "ALE/Breakout-v5",
            # v5's own (sticky actions 0.25), said on both sides; SB3's env is made with
            # frameskip=1 as well, its AtariWrapper skipping frames as trustrl's
            # AtariPreprocessing does (trustrl's make_atari passes frameskip=1 itself).
            "env_kwargs": {"repeat_action_probability": 0.25},
            "frame_stack": 4,
            "episodic_life": True,
            "clip_reward": True,
            "cnn": "nature",
        },
        # What differs on the env side, with the env-only ceilings of both stacks beside
        # each run to size it (benchmarks/README.md): SB3's AtariWrapper takes RGB frames
        # from ALE, max-pools them and converts to grey with OpenCV (WarpFrame, after its
        # own frame skip), where Gymnasium's AtariPreprocessing reads ALE's grey screen;
        # SB3 stacks channels last (VecFrameStack) and transposes to (4, 84, 84) for the
        # CNN (VecTransposeImage), trustrl stacks channels first (FrameStackObservation);
        # SB3 clips rewards in the wrapper, trustrl in the collector; SB3's DummyVecEnv
        # resets within the step that ended an episode (every lost life, with episodic
        # life), trustrl's NEXT_STEP autoreset spends one row on it, counted in its env
        # steps (the worker reports the share of such rows).
        "time_split": True,
        "rollout_memory": True,
        "quick_steps": 2_048,
    },
    8: {
        "title": "PPO MinAtar/Breakout-v1 (MinAtar CNN, shared), 8 sync envs x 128, 100k steps",
        "peer": "sb3",
        "settings": {
            **PIXEL_PPO,
            "env_id": "MinAtar/Breakout-v1",
            # SB3's NatureCNN needs frames of 36 px and more: it gets a features extractor
            # equal to trustrl's small CNN (bool grids cast to float, channels last
            # permuted to first, normalize_images=False), benchmarks/worker.py.
            "cnn": "minatar",
        },
        "time_split": True,
        "rollout_memory": True,
        "quick_steps": 2_048,
    },
    9: {
        "title": "Recurrent PPO (LSTM), velocity-masked CartPole, 8 sync envs x 32, time until "
        "the last-20-episode mean >= 475",
        "peer": "sb3-contrib",
        "peer_name": "sb3-contrib RecurrentPPO",
        "threshold": {"return": 475.0, "window": 20},
        "settings": {
            # examples/masked.py: CartPole-v1's positions only (the zoo's CartPoleNoVel-v1),
            # with the zoo's RecurrentPPO settings for it (lr and clip annealed, 20 epochs
            # of one 256-row minibatch, observations and rewards normalized: the zoo's
            # `normalize: True` is VecNormalize's both; ReLU, no orthogonal init).
            "env_id": "examples.masked:cartpole",
            "num_envs": 8,
            "num_steps": 32,
            "gamma": 0.98,
            "gae_lambda": 0.8,
            "learning_rate": 1e-3,
            "anneal_lr": True,
            "clip_coef": 0.2,
            "anneal_clip": True,
            "update_epochs": 20,
            "num_minibatches": 1,
            "normalize_obs": True,
            "normalize_reward": True,
            "hidden_sizes": [64],
            "activation": "relu",
            "ortho_init": False,
            "memory": "lstm",
            "memory_size": 64,
            "total_steps": 100_000,  # a budget: the run stops once the threshold is met
        },
        "quick_steps": 2_048,
    },
}


def settings(case_id: int, quick: bool = False) -> dict[str, Any]:
    """The case's full settings (defaults filled in), the step budget rounded down to
    whole iterations so both libraries run, and anneal over, the same number of them."""
    case = CASES[case_id]
    out = {**DEFAULTS, **copy.deepcopy(case["settings"])}
    if quick:
        out["total_steps"] = min(out["total_steps"], case["quick_steps"])
    batch = out["num_envs"] * out["num_steps"]
    out["total_steps"] = max(1, out["total_steps"] // batch) * batch
    return out


# The translations.


def trustrl_table(s: dict[str, Any], seed: int, run_dir: str) -> dict[str, Any]:
    """Settings -> a full trustrl config table (for trustrl.config.config_from_dict).

    Built from scratch rather than through trustrl.resolve, so no preset leaks in.
    """
    table: dict[str, Any] = {
        "env_id": s["env_id"],
        "algo": s["algo"],
        "seed": seed,
        "total_steps": s["total_steps"],
        "run_dir": run_dir,
        "quiet": True,
        "torch_threads": s["torch_threads"],
        "eval_episodes": 0,
        "target_return": None,
        "env": {
            "num_envs": s["num_envs"],
            "backend": s["backend"],
            "normalize_obs": s["normalize_obs"],
            "normalize_reward": s["normalize_reward"],
            "obs_clip": s["obs_clip"],
            "reward_clip": s["reward_clip"],
            "kwargs": dict(s["env_kwargs"]),
            "frame_stack": s["frame_stack"],
            "episodic_life": s["episodic_life"],
            "clip_reward": s["clip_reward"],
        },
        "rollout": {
            "num_steps": s["num_steps"],
            "gamma": s["gamma"],
            "gae_lambda": s["gae_lambda"],
        },
        "policy": {
            "hidden_sizes": tuple(s["hidden_sizes"]),
            "activation": s["activation"],
            "ortho_init": s["ortho_init"],
            "share_encoder": s["share_encoder"],
            "memory": s["memory"],
            "memory_size": s["memory_size"],
        },
    }
    if s["memory"] != "none":  # RecurrentPPO's sequences: each env's whole rollout
        table["rollout"]["sequence_length"] = s["num_steps"]
        # RecurrentPPO's order: the core on the observation, its net_arch after it.
        table["policy"]["hidden_sizes"] = ()
        table["policy"]["post_memory_sizes"] = tuple(s["hidden_sizes"])
    if s["algo"] == "ppo":
        table["ppo"] = {
            "learning_rate": s["learning_rate"],
            "anneal_lr": s["anneal_lr"],
            "update_epochs": s["update_epochs"],
            "num_minibatches": s["num_minibatches"],
            "clip_coef": s["clip_coef"],
            "anneal_clip": s["anneal_clip"],
            "ent_coef": s["ent_coef"],
            "vf_coef": s["vf_coef"],
            "max_grad_norm": s["max_grad_norm"],
            # The documented speed-up for a machine with a core to spare (a benchmark
            # pair runs alone on it): docs/performance.md. The numpy gradients' (not a
            # recurrent policy's).
            "critic_process": s["memory"] == "none",
        }
    else:
        table["trpo"] = {
            "max_kl": s["max_kl"],
            "cg_iters": s["cg_iters"],
            "cg_damping": s["cg_damping"],
            "line_search_steps": s["line_search_steps"],
            "line_search_shrink": s["line_search_shrink"],
            "vf_lr": s["vf_lr"],
            "train_vf_iters": s["train_vf_iters"],
            "minibatches": s["num_minibatches"],
        }
    # TOML/None hygiene: config_from_dict accepts None for optional fields.
    return {k: v for k, v in table.items() if v is not None}


class LinearSchedule:
    """SB3 schedule matching trustrl's linear decay exactly.

    trustrl scales by 1 - k/K at iteration k (0-based, before collecting it). SB3 calls
    the schedule after collecting iteration k, with progress_remaining = 1 - (k+1)/K, so
    adding one iteration's share (batch / total) gives the same value at every update.
    """

    def __init__(self, initial: float, anneal: bool, batch: int, total: int) -> None:
        self.initial, self.anneal = initial, anneal
        self.shift = batch / total

    def __call__(self, progress_remaining: float) -> float:
        if not self.anneal:
            return self.initial
        return self.initial * min(1.0, progress_remaining + self.shift)

    def __repr__(self) -> str:
        if not self.anneal:
            return repr(self.initial)
        return f"linear({self.initial:g} -> 0)"


def sb3_setup(s: dict[str, Any], seed: int) -> dict[str, Any]:
    """Settings -> Stable-Baselines3 PPO / sb3-contrib TRPO constructor arguments.

    Returns {"algo": "PPO" | "TRPO", "policy": "MlpPolicy" | "CnnPolicy", "kwargs": {...},
    "vec_normalize": {...} | None, "env": {...}}; the policy's activation is named ("tanh"),
    the worker turns it into nn.Tanh, and a custom features extractor by its name in
    ``features_extractor_class`` ("minatar"), the worker's class of that name.
    """
    batch = s["num_envs"] * s["num_steps"]
    minibatch = batch // s["num_minibatches"]
    policy_kwargs: dict[str, Any] = {
        "net_arch": {"pi": list(s["hidden_sizes"]), "vf": list(s["hidden_sizes"])},
        "activation_fn": s["activation"],
        "ortho_init": s["ortho_init"],
        "log_std_init": 0.0,
    }
    policy = "MlpPolicy"
    if s["memory"] == "lstm":
        policy = "MlpLstmPolicy"
        policy_kwargs.update(
            lstm_hidden_size=s["memory_size"], enable_critic_lstm=True, shared_lstm=False
        )
    elif s["memory"] != "none":
        raise ValueError(f"sb3-contrib's RecurrentPPO has an LSTM only, not {s['memory']!r}")
    if s["cnn"] is not None:
        if s["algo"] != "ppo" or not s["share_encoder"]:
            raise ValueError("the image cases are PPO with the encoder shared (CnnPolicy's)")
        policy = "CnnPolicy"
        policy_kwargs["share_features_extractor"] = True
        if s["cnn"] == "nature":  # NatureCNN, CnnPolicy's own; frames scaled by 1/255
            policy_kwargs["features_extractor_kwargs"] = {"features_dim": 512}
        elif s["cnn"] == "minatar":  # bool grids: no scaling
            policy_kwargs["features_extractor_class"] = "minatar"
            policy_kwargs["features_extractor_kwargs"] = {"features_dim": 128}
            policy_kwargs["normalize_images"] = False
        else:
            raise ValueError(f"unknown cnn {s['cnn']!r}")
    env: dict[str, Any] = {"env_kwargs": dict(s["env_kwargs"]), "atari": False}
    if s["env_id"].startswith("ALE/"):
        # SB3's make_atari_env: gym.make(id, **env_kwargs), Monitor, AtariWrapper; then
        # VecFrameStack. frameskip=1: AtariWrapper skips frames itself (MaxAndSkipEnv).
        env = {
            "atari": True,
            "env_kwargs": {**s["env_kwargs"], "frameskip": 1},
            "wrapper_kwargs": {
                "noop_max": 30,
                "frame_skip": 4,
                "screen_size": 84,
                "terminal_on_life_loss": s["episodic_life"],
                "clip_reward": s["clip_reward"],
            },
            "frame_stack": s["frame_stack"] or 4,
        }
    elif s["frame_stack"] or s["clip_reward"]:
        raise ValueError("frame_stack and clip_reward are translated for ALE ids only")
    common = {
        "n_steps": s["num_steps"],
        "batch_size": minibatch,
        "gamma": s["gamma"],
        "gae_lambda": s["gae_lambda"],
        "normalize_advantage": True,
        "policy_kwargs": policy_kwargs,
        "seed": seed,
        "device": "cpu",
        "verbose": 0,
    }
    if s["algo"] == "ppo":
        kwargs = {
            **common,
            "n_epochs": s["update_epochs"],
            "learning_rate": LinearSchedule(
                s["learning_rate"], s["anneal_lr"], batch, s["total_steps"]
            ),
            "clip_range": LinearSchedule(s["clip_coef"], s["anneal_clip"], batch, s["total_steps"]),
            "clip_range_vf": None,
            "ent_coef": s["ent_coef"],
            "vf_coef": s["vf_coef"],
            "max_grad_norm": s["max_grad_norm"],
            "target_kl": None,
        }
        algo = "RecurrentPPO" if s["memory"] != "none" else "PPO"
    else:
        kwargs = {
            **common,
            "learning_rate": s["vf_lr"],  # the critic's Adam step size
            "n_critic_updates": s["train_vf_iters"],
            "cg_max_steps": s["cg_iters"],
            "cg_damping": s["cg_damping"],
            "line_search_shrinking_factor": s["line_search_shrink"],
            "line_search_max_iter": s["line_search_steps"],
            "target_kl": s["max_kl"],
        }
        algo = "TRPO"
    vec_normalize = None
    if s["normalize_obs"] or s["normalize_reward"]:
        vec_normalize = {
            "norm_obs": s["normalize_obs"],
            "norm_reward": s["normalize_reward"],
            "clip_obs": s["obs_clip"],
            "clip_reward": s["reward_clip"],
            "gamma": s["gamma"],
        }
    return {
        "algo": algo,
        "policy": policy,
        "kwargs": kwargs,
        "vec_normalize": vec_normalize,
        "env": env,
    }


def describe_sb3(setup: dict[str, Any]) -> dict[str, Any]:
    """A JSON-able view of sb3_setup's result (schedules by their repr)."""

    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [plain(v) for v in value]
        if isinstance(value, LinearSchedule):
            return repr(value)
        return value

    return plain(setup)
