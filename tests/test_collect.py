"""The collector against hand-built episodes, on the sync and the async backend.

The scripted envs (tests/envs.py) have known episode lengths and endings and
observations ``[tag, episode, step]``, so every row of the rollout can be predicted:
which rows are reset rows (valid=False, holding the previous episode's final
observation), the rewards and the terminated/truncated flags, the episodes the collector
reports, and, with the critic replaced by a known function of the observation, every
advantage GAE must produce.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch

from tests import envs as E
from tests.collecting import collect
from trustrl.acting.collector import Collector
from trustrl.acting.inference import Inference
from trustrl.config import PolicyConfig, config_from_dict, merge
from trustrl.envs.spaces import SpaceSpec
from trustrl.learner.policy import Policy
from trustrl.run.trainer import Trainer

NEXT_STEP = gym.vector.AutoresetMode.NEXT_STEP
BACKENDS = ["sync", "async"]
GAMMA, LAM = 0.9, 0.8


def vector_env(backend: str, fns: list[Callable[[], gym.Env]]) -> gym.vector.VectorEnv:
    if backend == "async":
        return gym.vector.AsyncVectorEnv(fns, shared_memory=True, autoreset_mode=NEXT_STEP)
    return gym.vector.SyncVectorEnv(fns, autoreset_mode=NEXT_STEP)


def known_value(obs: torch.Tensor, *_: object) -> torch.Tensor:
    """The critic for these tests: V([tag, episode, step]) = 0.5 + 2 episode + 0.25 step."""
    return 0.5 + 2.0 * obs[..., 1] + 0.25 * obs[..., 2]


def use_known_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """The collector's critic (numpy inference, see trustrl/acting/inference.py) -> known_value."""

    def raw_value(self: Inference, x: np.ndarray, *_: object) -> np.ndarray:
        return known_value(torch.from_numpy(x)).numpy()

    monkeypatch.setattr(Inference, "_raw_value", raw_value)


def known_value_np(obs: np.ndarray) -> float:
    return float(known_value(torch.as_tensor(obs, dtype=torch.float32)))


# --- The expected timeline of one scripted env under NEXT_STEP autoreset. ---


def expected_rows(
    schedule: str, tag: int, max_episode_steps: int | None, num_rows: int
) -> tuple[list[dict], list[tuple[int, float, int]]]:
    """Rows the collector must write for one env, and the episodes that finish.

    Each row: valid, obs (acted on), reward, terminated, truncated (as stored: truncated
    only when not also terminated). Each finished episode: (row where it ended, return,
    length).
    """
    items = E.parse_schedule(schedule)
    rows: list[dict] = []
    episodes: list[tuple[int, float, int]] = []
    episode = 0
    while len(rows) < num_rows:
        length, ending = items[episode % len(items)]
        limit = max_episode_steps or 10**9
        steps = min(length if ending != "never" else 10**9, limit)
        ret = 0.0
        for k in range(steps):
            reward = E.scripted_reward(tag, episode, k + 1)
            ret += reward
            last = k == steps - 1
            scripted_end = last and steps == length and ending != "never"
            terminated = scripted_end and ending in ("terminated", "both")
            truncated = last and (
                (scripted_end and ending in ("truncated", "both")) or steps == limit
            )
            rows.append(
                {
                    "valid": True,
                    "obs": [tag, episode, k],
                    "reward": reward,
                    "terminated": float(terminated),
                    "truncated": float(truncated and not terminated),
                }
            )
            if last:
                episodes.append((len(rows) - 1, ret, steps))
        # The reset row: acts on the final observation, reward 0, no flags.
        rows.append(
            {
                "valid": False,
                "obs": [tag, episode, steps],
                "reward": 0.0,
                "terminated": 0.0,
                "truncated": 0.0,
            }
        )
        episode += 1
    return rows, episodes


def reference_advantages(rows: list[dict], start: int, stop: int) -> list[float]:
    """GAE for rows[start:stop] with the known critic, written out per episode.

    The rollout ends at ``stop``; its last row bootstraps from V(rows[stop].obs).
    A terminated row has no bootstrap; a truncated one bootstraps from V(final obs),
    which is the obs of the following reset row. Both stop the accumulation.
    """
    advantages = [0.0] * (stop - start)
    running = 0.0
    for t in range(stop - 1, start - 1, -1):
        row = rows[t]
        value = known_value_np(np.array(row["obs"], dtype=np.float32))
        next_value = known_value_np(np.array(rows[t + 1]["obs"], dtype=np.float32))
        if not row["valid"]:
            # A reset row is never trained on; what GAE leaves there does not matter,
            # but it must not leak into the row before it (which ended an episode).
            delta = row["reward"] + GAMMA * next_value - value
            running = delta + GAMMA * LAM * running
            advantages[t - start] = float("nan")
            continue
        bootstrap = 0.0 if row["terminated"] else GAMMA * next_value
        delta = row["reward"] + bootstrap - value
        ended = row["terminated"] or row["truncated"]
        running = delta + (0.0 if ended else GAMMA * LAM * running)
        advantages[t - start] = running
    return advantages


# env 0: its own flags; an episode truncates on the last row of the first rollout.
# env 1: episodes never end by themselves, a TimeLimit truncates them after 2 steps.
# env 2: terminated and truncated together at step 2 (counts as termination), then a
#        TimeLimit of 3 cuts a 4-step episode.
SCRIPTS = [
    ("2:terminated,2:truncated,3:terminated", 0, None),
    ("5:never", 1, 2),
    ("2:both,4:terminated", 2, 3),
]
CHUNKS = (5, 9)  # two collect calls: the collector must carry the reset state across


def scripted_collector(backend: str) -> Collector:
    fns = [
        functools.partial(E.make_scripted, schedule, tag, limit) for schedule, tag, limit in SCRIPTS
    ]
    return Collector(vector_env(backend, fns), seed=0, gamma=GAMMA)


def small_policy(collector: Collector, **kwargs) -> Policy:
    torch.manual_seed(0)
    return Policy(collector.spec, PolicyConfig(hidden_sizes=(8,)), **kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_autoreset_rows_flags_bootstrap_and_episodes(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    collector = scripted_collector(backend)
    policy = small_policy(collector)
    use_known_value(monkeypatch)
    total = sum(CHUNKS)
    expected = [expected_rows(s, tag, limit, total + 1) for s, tag, limit in SCRIPTS]
    try:
        start = 0
        all_returns: list[float] = []
        all_lengths: list[int] = []
        for chunk in CHUNKS:
            rollout, stats = collect(collector, policy, chunk)
            rollout.compute_advantages(GAMMA, LAM)
            all_returns += stats.returns
            all_lengths += stats.lengths
            for i, (rows, _) in enumerate(expected):
                want = rows[start : start + chunk]
                where = f"{backend} env {i} rows {start}..{start + chunk - 1}"
                assert rollout.valid[:, i].tolist() == [r["valid"] for r in want], where
                assert rollout.obs[:, i].tolist() == [r["obs"] for r in want], where
                assert rollout.rewards[:, i].tolist() == [r["reward"] for r in want], where
                assert rollout.terminated[:, i].tolist() == [r["terminated"] for r in want], where
                assert rollout.truncated[:, i].tolist() == [r["truncated"] for r in want], where
                # The critic ran on exactly the rows' observations, reset rows included
                # (their value is V(final observation), the truncation bootstrap).
                assert torch.equal(rollout.values[:, i], known_value(rollout.obs[:, i]))
                assert rollout.last_value[i] == known_value_np(
                    np.array(rows[start + chunk]["obs"], dtype=np.float32)
                )
                reference = reference_advantages(rows, start, start + chunk)
                for t, ref in enumerate(reference):
                    if rollout.valid[t, i]:
                        assert rollout.advantages[t, i].item() == pytest.approx(
                            ref, rel=1e-5, abs=1e-5
                        ), f"{where}: advantage of row {start + t}"
                        assert rollout.returns[t, i].item() == pytest.approx(
                            ref + rollout.values[t, i].item(), rel=1e-5, abs=1e-5
                        )
            # Only valid rows reach training.
            batch = rollout.flat()
            assert len(batch) == int(rollout.valid.sum())
            assert torch.equal(batch.obs, rollout.obs[rollout.valid])
            start += chunk

        # Every finished episode is reported once, in the order the episodes ended.
        finished = sorted(
            (row, i, ret, length)
            for i, (_, eps) in enumerate(expected)
            for row, ret, length in eps
            if row < total
        )
        assert all_returns == [ret for _, _, ret, _ in finished]
        assert all_lengths == [length for _, _, _, length in finished]
    finally:
        collector.close()


def test_truncation_bootstraps_from_final_observation_termination_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The two endings spelled out with numbers, independent of the reference sweep."""
    collector = scripted_collector("sync")
    policy = small_policy(collector)
    use_known_value(monkeypatch)
    try:
        rollout, _ = collect(collector, policy, 5)
    finally:
        collector.close()
    rollout.compute_advantages(GAMMA, LAM)
    adv = rollout.advantages

    # env 0, row 1: last step of episode 0, terminated. obs [0, 0, 1], reward 2.
    assert rollout.terminated[1, 0] == 1.0
    assert adv[1, 0].item() == pytest.approx(2.0 - (0.5 + 0.25))
    # env 0, row 4: last step of episode 1, truncated and the last row of the rollout:
    # obs [0, 1, 1], reward 12, final obs [0, 1, 2] (only known through last_value).
    assert rollout.truncated[4, 0] == 1.0
    v_final = 0.5 + 2.0 + 0.25 * 2
    assert rollout.last_value[0].item() == pytest.approx(v_final)
    assert adv[4, 0].item() == pytest.approx(12.0 + GAMMA * v_final - (0.5 + 2.0 + 0.25))
    # env 1, row 1: truncated by the TimeLimit; the next row is the reset row holding
    # the final observation [1, 0, 2], whose value is the bootstrap.
    assert rollout.truncated[1, 1] == 1.0 and not rollout.valid[2, 1]
    assert rollout.obs[2, 1].tolist() == [1.0, 0.0, 2.0]
    v_final = 0.5 + 0.25 * 2
    assert adv[1, 1].item() == pytest.approx(102.0 + GAMMA * v_final - (0.5 + 0.25))
    # ... and the row before it accumulates through it, not through the reset row.
    delta0 = 101.0 + GAMMA * (0.5 + 0.25) - 0.5
    assert adv[0, 1].item() == pytest.approx(delta0 + GAMMA * LAM * adv[1, 1].item())
    # env 2, row 1: terminated and truncated at once counts as terminated: no bootstrap.
    assert rollout.terminated[1, 2] == 1.0 and rollout.truncated[1, 2] == 0.0
    assert adv[1, 2].item() == pytest.approx(202.0 - (0.5 + 0.25))


def masked_collector(backend: str, env_cls: type, num_envs: int = 3) -> Collector:
    return Collector(vector_env(backend, [env_cls] * num_envs), seed=3, gamma=GAMMA)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("env_cls", [E.MaskedInfoEnv, E.MaskedDictEnv])
def test_masks_are_respected(backend: str, env_cls: type) -> None:
    collector = masked_collector(backend, env_cls)
    spec = collector.spec
    assert spec.masked and spec.dict_obs == (env_cls is E.MaskedDictEnv)
    policy = small_policy(collector)
    with torch.no_grad():
        # Sharp, obs-dependent preferences: without the mask, forbidden actions are
        # sampled often (and the strict env raises on them).
        policy.head.linear.weight.mul_(300.0)
        policy.head.linear.bias.copy_(torch.linspace(-3.0, 3.0, spec.nvec[0]))
    try:
        for _ in range(2):
            rollout, _ = collect(collector, policy, 24)
            assert rollout.action_mask is not None
            steps = rollout.obs[..., 0].long()  # both envs put the step first
            n = spec.nvec[0]
            want = torch.stack(
                [torch.as_tensor(E.allowed_actions(int(s), n)) for s in steps.reshape(-1).tolist()]
            ).reshape(*steps.shape, n)
            assert torch.equal(rollout.action_mask, want)
            chosen = rollout.action_mask.gather(-1, rollout.actions.unsqueeze(-1)).squeeze(-1)
            assert chosen.all(), "a sampled action is masked out"
            # Negative control: the same policy without its mask would pick forbidden ones.
            unmasked = policy.head.mode(policy.dist_params(rollout.obs))
            allowed = rollout.action_mask.gather(-1, unmasked.unsqueeze(-1)).squeeze(-1)
            assert not allowed.all()
            # More than one allowed action was used, so the check above is not trivial.
            assert len(set(rollout.actions.reshape(-1).tolist())) > 1
            # The stored log-probabilities are those of the masked distribution.
            params = policy.dist_params(rollout.obs, rollout.action_mask)
            logprob = policy.head.log_prob(params, rollout.actions)
            torch.testing.assert_close(rollout.logprob, logprob)
            assert torch.isfinite(rollout.logprob).all()
            assert (rollout.logprob > -30).all()
    finally:
        collector.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_box_actions_clipped_for_env_only(backend: str) -> None:
    collector = Collector(
        vector_env(backend, [functools.partial(E.ImageBoxEnv, length=4)] * 2), seed=5, gamma=GAMMA
    )
    spec = collector.spec
    assert spec.obs_shape == (3, 4, 4) and spec.obs_dim == 48
    assert spec.action_kind == "box" and spec.action_shape == (2,)
    policy = small_policy(collector)
    with torch.no_grad():
        policy.head.log_std.fill_(1.0)  # std e: most samples fall outside [-1, 1]
    try:
        rollout, _ = collect(collector, policy, 16)
    finally:
        collector.close()
    actions = rollout.actions
    assert actions.dtype == torch.float32 and actions.shape == (16, 2, 2)
    assert (actions.abs() > 1.0).any(), "no sample out of bounds: the test would be vacuous"
    # The image observation is flattened row-major: pixel [1, 0, 0] is the step count.
    first = np.linspace(-1.0, 1.0, 48, dtype=np.float32)
    first[[0, 1, 16]] = 0.0  # no action yet, step 0
    assert torch.equal(rollout.obs[0, 0], torch.from_numpy(first))
    # What reached the env (echoed in the next observation) is the clipped sample.
    checked = 0
    for t in range(15):
        for i in range(2):
            if rollout.valid[t, i]:
                sent = rollout.obs[t + 1, i, 0:2]
                assert torch.equal(sent, actions[t, i].clamp(-1.0, 1.0)), (t, i)
                checked += 1
    assert checked >= 20
    # The rollout's log-probability is that of the unclipped sample.
    params = policy.dist_params(rollout.obs)
    torch.testing.assert_close(rollout.logprob, policy.head.log_prob(params, actions))
    clipped_logprob = policy.head.log_prob(params, actions.clamp(-1.0, 1.0))
    outside = (actions.abs() > 1.0).any(-1)
    assert not torch.allclose(rollout.logprob[outside], clipped_logprob[outside])


@pytest.mark.parametrize("obs_stats", ["rollout", "step"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_obs_normalization_updates_only_when_training(backend: str, obs_stats: str) -> None:
    """The learner's statistics take in every observation of a training rollout (its
    delta, merged once); the statistics that act are the snapshot's, frozen for the
    rollout, or with ``obs_stats="step"`` updated at every step as well."""
    collector = scripted_collector(backend)
    collector.obs_stats = obs_stats  # type: ignore[assignment]
    policy = small_policy(collector, normalize_obs=True)
    normalizer = policy.obs_normalizer
    assert normalizer is not None
    rows = [expected_rows(s, tag, limit, 40)[0] for s, tag, limit in SCRIPTS]
    raw = torch.tensor(
        [[rows[i][t]["obs"] for i in range(3)] for t in range(40)], dtype=torch.float32
    )
    try:
        # Not training: statistics frozen at their initial values (mean 0, var 1).
        rollout, _ = collect(collector, policy, 6, train=False)
        assert normalizer.count.item() == 0
        assert torch.equal(normalizer.mean, torch.zeros(3, dtype=torch.float64))
        torch.testing.assert_close(rollout.obs, raw[:6])

        # Training: every observation acted on is folded in, reset rows included.
        rollout, _ = collect(collector, policy, 8, train=True)
        assert normalizer.count.item() == 8 * 3
        seen = raw[6:14].reshape(-1, 3).double()
        torch.testing.assert_close(normalizer.mean, seen.mean(0))
        torch.testing.assert_close(normalizer.var, seen.var(0, unbiased=False))
        # The rollout holds observations as acted on.
        if obs_stats == "step":  # the last row with the statistics that took it in
            torch.testing.assert_close(rollout.obs[-1], normalizer(raw[13]))
        else:  # the snapshot's statistics (mean 0, var 1 here): frozen for the rollout
            torch.testing.assert_close(rollout.obs, raw[6:14].clamp(-10.0, 10.0))
        mean, var = normalizer.mean.clone(), normalizer.var.clone()

        rollout, _ = collect(collector, policy, 5, train=False)
        assert normalizer.count.item() == 8 * 3
        assert torch.equal(normalizer.mean, mean) and torch.equal(normalizer.var, var)
        torch.testing.assert_close(rollout.obs, normalizer(raw[14:19]))
    finally:
        collector.close()


def test_reward_scaler_updates_only_when_training() -> None:
    fns = [functools.partial(E.make_scripted, "3:truncated", 0)]
    collector = Collector(vector_env("sync", fns), seed=0, gamma=GAMMA, normalize_reward=True)
    policy = small_policy(collector)
    scaler = collector.reward_scaler
    assert scaler is not None
    try:
        rollout, _ = collect(collector, policy, 6, train=False)
        assert scaler.count.item() == 0
        # Unit variance: rewards pass through unscaled (up to epsilon).
        torch.testing.assert_close(rollout.rewards[:3, 0], torch.tensor([1.0, 2.0, 3.0]))
        rollout, _ = collect(collector, policy, 6, train=True)
        # Only valid rows update the scaler (reset rows carry no reward).
        assert scaler.count.item() == int(rollout.valid.sum())
        assert scaler.var.item() != 1.0
    finally:
        collector.close()


@pytest.mark.parametrize("num_envs", [1, 2])  # one row: the Python-float path
def test_reward_scaling_against_a_brute_force_reference(num_envs: int) -> None:
    """Each step's reward over the std of every discounted return folded in so far (that
    step's included), the discounted return restarting after each episode end."""
    schedules = ["3:truncated", "2:terminated,4:truncated"][:num_envs]

    def collector(normalize: bool) -> Collector:
        fns = [functools.partial(E.make_scripted, sched, i) for i, sched in enumerate(schedules)]
        return Collector(vector_env("sync", fns), 0, GAMMA, normalize_reward=normalize)

    plain, scaled = collector(False), collector(True)
    policy = small_policy(plain)
    folded: list[float] = []
    discounted = np.zeros(num_envs)
    try:
        for _ in range(3):  # the discounted return carries over from rollout to rollout
            raw, _ = collect(plain, policy, 7)
            out, _ = collect(scaled, policy, 7)
            for t in range(7):
                reward = raw.rewards[t].double().numpy()
                valid = raw.valid[t].numpy()
                discounted = discounted * GAMMA + reward
                folded += discounted[valid].tolist()
                var = np.var(folded) if folded else 1.0
                expected = np.clip(reward / np.sqrt(var + 1e-8), -10, 10)
                np.testing.assert_allclose(out.rewards[t].numpy(), expected, rtol=1e-5)
                done = (raw.terminated[t] + raw.truncated[t]).numpy() > 0
                discounted[done] = 0.0
        assert scaled.reward_scaler is not None
        assert scaled.reward_scaler.count.item() == len(folded)
    finally:
        plain.close()
        scaled.close()


@pytest.mark.parametrize("backend", ["vector", "sync", "async"])
def test_cartpole_episode_accounting_on_every_backend(backend: str) -> None:
    """Real CartPole (reward 1 per step, a TimeLimit of 15): episodes seen in the rollout
    rows, their flags and the collector's report agree, on every backend."""
    from trustrl.envs.gym import make_vec_env

    limit = 15
    envs = make_vec_env("CartPole-v1", 3, backend, {"max_episode_steps": limit})
    collector = Collector(envs, seed=11, gamma=GAMMA)
    policy = small_policy(collector)
    try:
        rollout, stats = collect(collector, policy, 60)
    finally:
        collector.close()
    valid, term, trunc = rollout.valid, rollout.terminated, rollout.truncated
    assert torch.equal(rollout.rewards, valid.float()), "reward 1 on valid rows, 0 on resets"
    ended: list[tuple[int, int, int]] = []  # (row, env, length)
    for i in range(3):
        length = 0
        for t in range(60):
            if not valid[t, i]:
                # A reset row follows exactly the rows that ended an episode.
                assert t > 0 and (term[t - 1, i] or trunc[t - 1, i]), (t, i)
                continue
            length += 1
            done = bool(term[t, i] or trunc[t, i])
            assert not (term[t, i] and trunc[t, i])
            if done:
                ended.append((t, i, length))
                assert bool(trunc[t, i]) == (length == limit), (t, i, length)
                length = 0
            if t + 1 < 60:
                assert bool(valid[t + 1, i]) == (not done), (t, i)
    ended.sort()
    assert stats.lengths == [length for _, _, length in ended]
    assert stats.returns == [float(length) for _, _, length in ended]
    assert bool(trunc.any()) and bool(term.any()), "both endings should occur"


# The per-rollout log-probabilities and values: what the update trains against.


def _rollout_matches_policy(trainer: Any) -> None:
    """Every stored log-probability and value of a fresh rollout is the torch policy's."""
    rollouts = trainer.collect().rollouts
    for policy, rollout in zip(trainer.policies, rollouts, strict=True):
        steps, rows = rollout.logprob.shape
        agent = rollout.agent.repeat(steps)
        mask = rollout.action_mask
        critic = rollout.critic_obs
        with torch.no_grad():
            params = policy.dist_params(
                rollout.obs.reshape(steps * rows, -1),
                mask.reshape(steps * rows, -1) if mask is not None else None,
                agent,
            )
            actions = rollout.actions.reshape(steps * rows, *rollout.actions.shape[2:])
            logprob = policy.head.log_prob(params, actions).reshape(steps, rows)
            value = policy.critic_value(
                rollout.obs.reshape(steps * rows, -1),
                critic.reshape(steps * rows, -1) if critic is not None else None,
                agent,
            ).reshape(steps, rows)
        valid = rollout.valid
        assert valid.any()
        torch.testing.assert_close(rollout.logprob[valid], logprob[valid], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rollout.values, value, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("env_id", "extra"),
    [
        ("CartPole-v1", {}),
        ("Pendulum-v1", {"env": {"num_envs": 3, "normalize_obs": True}}),
        ("tests.envs:MaskedInfoEnv", {}),
        ("tests.envs:MaskedDictEnv", {}),
        ("tests.envs:MultiDiscreteEnv", {}),
    ],
)
def test_rollout_log_probs_and_values_are_the_policys(
    env_id: str, extra: dict[str, Any], tmp_path: Path
) -> None:
    table = merge(
        {
            "env_id": env_id,
            "total_steps": 64,
            "quiet": True,
            "eval_episodes": 0,
            "run_dir": str(tmp_path),
            "env": {"num_envs": 2},
            "rollout": {"num_steps": 32},
            "policy": {"hidden_sizes": [16, 16]},
        },
        extra,
    )
    trainer = Trainer(config_from_dict(table))
    trainer.train(iterations=1)  # weights away from their initial values
    _rollout_matches_policy(trainer)


@pytest.mark.parametrize(
    "multiagent",
    [
        {"actor": "shared", "critic_input": "global"},
        {"actor": "per_agent", "critic_input": "agent_centric", "value_norm": True},
    ],
)
def test_multiagent_rollout_log_probs_and_values_are_the_policys(
    multiagent: dict[str, Any], tmp_path: Path
) -> None:
    table = {
        "env_id": "mpe2:simple_spread_v3",
        "total_steps": 100,
        "quiet": True,
        "eval_episodes": 0,
        "run_dir": str(tmp_path),
        "env": {"num_envs": 2, "kwargs": {"continuous_actions": True, "max_cycles": 12}},
        "rollout": {"num_steps": 25},
        "policy": {"hidden_sizes": [16, 16]},
        "multiagent": multiagent,
    }
    trainer = Trainer(config_from_dict(table))
    trainer.train(iterations=1)
    _rollout_matches_policy(trainer)


def test_the_trainers_collect_returns_what_it_measured(tmp_path: Path) -> None:
    """``Trainer.collect`` returns the rollouts, the episodes that ended, the env steps and
    the version lag; it leaves the run's own counts to the iteration that trains on them."""
    table = {
        "env_id": "CartPole-v1",
        "total_steps": 128,
        "quiet": True,
        "eval_episodes": 0,
        "run_dir": str(tmp_path),
        "env": {"num_envs": 2},
        "rollout": {"num_steps": 32},
        "policy": {"hidden_sizes": [16]},
    }
    trainer = Trainer(config_from_dict(table))
    collected = trainer.collect()
    assert collected.env_steps == 2 * 32 and collected.version_lag == 0
    (rollout,) = collected.rollouts
    assert rollout.logprob.shape == (32, 2)
    episodes = collected.episodes
    assert len(episodes.returns) == len(episodes.lengths) >= 1  # CartPole's early episodes
    assert sum(episodes.lengths) <= 2 * 32  # episodes that began with the rollout
    assert trainer.iteration == 0 and trainer.env_steps == 0


@pytest.mark.parametrize("shape", [(3,), (2, 2)])
def test_to_env_clips_box_actions_and_gives_the_env_its_shape(shape: tuple[int, ...]) -> None:
    spec = SpaceSpec.from_spaces(
        gym.spaces.Box(-1.0, 1.0, (4,), np.float32),
        gym.spaces.Box(-0.5, 2.0, shape, np.float32),
        False,
    )
    flat = np.array([[-3.0, 0.25, 5.0, 1.0][: int(np.prod(shape))]] * 2, dtype=np.float32)
    env_actions = spec.to_env(flat)
    assert env_actions.shape == (2, *shape)
    np.testing.assert_array_equal(env_actions.reshape(2, -1), np.clip(flat, -0.5, 2.0))
