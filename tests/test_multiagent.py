"""Multi-agent PPO: agents as rows, masking, stacked per-agent actors, critic inputs,
heterogeneous groups, checkpoints, metrics and registering agents while training.

The scripted env (tests/coop_env.py) ends each agent's episode at a chosen step with a
chosen flag and says in its observations and rewards which agent, episode and step a row
holds, so every row of a rollout has a known expected value.
"""

from __future__ import annotations

import copy
import csv
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gymnasium import spaces
from torch import nn

import trustrl
from tests.collecting import collect
from tests.coop_env import scripted_reward
from trustrl.acting.collector import Collector
from trustrl.config import PolicyConfig, PPOConfig, config_from_dict, merge
from trustrl.envs.pettingzoo import ParallelRows, parallel_env_factory
from trustrl.envs.spaces import SpaceSpec
from trustrl.learner.heads import StackedLinear
from trustrl.learner.policy import MultiAgentPolicy, Policy
from trustrl.learner.rollout import Rollout
from trustrl.learner.updates.ppo import PPOUpdate
from trustrl.run.evaluation import evaluate_parallel
from trustrl.run.trainer import Trainer

SCRIPTED = "tests.coop_env:ScriptedParallelEnv"
SPREAD = "mpe2:simple_spread_v3"
# Default endings of the scripted env: (length, ending) per agent a0, a1, a2.
LENGTHS = (2, 3, 4)
PERIOD = max(LENGTHS) + 1  # an env episode, then its reset step
SMALL = PolicyConfig(hidden_sizes=(16, 16))


def table(env_id: str, run_dir: Path, **overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "env_id": env_id,
        "total_steps": 60,
        "quiet": True,
        "eval_episodes": 0,
        "run_dir": str(run_dir),
        "checkpoint_every": 1000,
        "env": {"num_envs": 2},
        "rollout": {"num_steps": 30},
        "policy": {"hidden_sizes": [16, 16]},
        "ppo": {"update_epochs": 2, "num_minibatches": 2},
    }
    return merge(base, overrides)


def trainer(env_id: str, run_dir: Path, **overrides: Any) -> Trainer:
    return Trainer(config_from_dict(table(env_id, run_dir, **overrides)))


def rows_env(env_id: str, num_envs: int, critic_input: str = "global", **kwargs: Any):
    return ParallelRows(parallel_env_factory(env_id, kwargs), num_envs, critic_input)


def scripted_rollout(
    num_steps: int,
    num_envs: int = 2,
    critic_input: str = "global",
    gamma: float = 0.9,
    policy_kwargs: dict[str, Any] | None = None,
    **env_kwargs: Any,
) -> tuple[Collector, Policy, Rollout, Any]:
    collector = Collector(rows_env(SCRIPTED, num_envs, critic_input, **env_kwargs), 0, gamma)
    group = collector.groups[0]
    policy = Policy(
        group.spec,
        SMALL,
        num_agents=group.num_agents,
        critic_dim=group.critic_dim,
        **(policy_kwargs or {"per_agent": True, "agent_id": True}),
    )
    rollout, stats = collect(collector, policy, num_steps)
    return collector, policy, rollout, stats


# Rows and masking.


def test_rows_are_envs_times_agents_in_env_agent_order(tmp_path: Path) -> None:
    rows = rows_env(SCRIPTED, 3)
    observed = rows.reset(seed=0)
    [group] = rows.groups
    assert group.agents == ("a0", "a1", "a2")
    assert observed[0].obs.shape == (9, 3)
    # Agent index fastest: row = env * 3 + agent.
    assert observed[0].obs[:, 0].tolist() == [0, 1, 2] * 3
    assert observed[0].alive is not None and observed[0].alive.all()
    rows.close()

    t = trainer(SPREAD, tmp_path, env={"num_envs": 3}, rollout={"num_steps": 7})
    [rollout] = t.collect().rollouts
    assert rollout.obs.shape == (7, 9, 18)
    assert rollout.agent.tolist() == [0, 1, 2] * 3
    assert rollout.critic_obs is not None and rollout.critic_obs.shape == (7, 9, 54)
    t.collector.close()


def test_scripted_rollout_rows_valid_rewards_and_flags() -> None:
    """Agents finish at steps 2 (truncated), 3 (terminated), 4 (truncated): a finished
    agent's rows are invalid with reward 0 until the env's reset step, which is invalid
    for every agent; no action ever reaches a finished agent (the env raises)."""
    steps = 12
    collector, _, rollout, stats = scripted_rollout(steps)
    for t in range(steps):
        episode, k = divmod(t, PERIOD)
        for env in range(2):
            for i, length in enumerate(LENGTHS):
                row = env * 3 + i
                valid = k < length
                where = f"t={t} env={env} agent={i}"
                assert bool(rollout.valid[t, row]) == valid, where
                expected = scripted_reward(i, episode, k + 1) if valid else 0.0
                assert rollout.rewards[t, row] == expected, where
                last = k == length - 1
                assert rollout.terminated[t, row] == float(last and i == 1), where
                assert rollout.truncated[t, row] == float(last and i != 1), where
                # The observation acted on; a finished agent keeps showing its final one.
                assert rollout.obs[t, row].tolist() == [i, episode, min(k, length)], where
    # Every action the envs received was for an agent still playing.
    for env in collector.envs:
        acting = [sorted(a) for a in env.actions_seen]
        expected_acting = [[f"a{i}" for i, n in enumerate(LENGTHS) if n > k] for k in range(4)]
        assert acting == expected_acting * (len(acting) // 4) + expected_acting[: len(acting) % 4]
    # Episode statistics: one entry per finished (env, agent) episode, raw rewards.
    expected_returns, expected_lengths, expected_agents = [], [], []
    for t in range(steps):
        episode, k = divmod(t, PERIOD)
        for i, length in enumerate(LENGTHS):
            if k == length - 1:
                total = sum(scripted_reward(i, episode, s) for s in range(1, length + 1))
                expected_returns += [total, total]
                expected_lengths += [length, length]
                expected_agents += [f"a{i}", f"a{i}"]
    assert stats.returns == expected_returns
    assert stats.lengths == expected_lengths
    assert stats.agents == expected_agents
    collector.close()


@pytest.mark.parametrize("length", [1, 3])
def test_all_agents_ending_together_makes_one_invalid_reset_step(length: int) -> None:
    endings = ",".join([f"{length}:terminated"] * 3)
    collector, _, rollout, stats = scripted_rollout(3 * (length + 1), endings=endings)
    expected = torch.tensor([t % (length + 1) < length for t in range(3 * (length + 1))])
    assert torch.equal(rollout.valid, expected[:, None].expand(-1, 6))
    assert len(stats.returns) == 3 * 6
    collector.close()


def test_truncation_bootstraps_termination_does_not() -> None:
    gamma, lam = 0.9, 0.8
    collector, policy, rollout, _ = scripted_rollout(
        8, num_envs=1, critic_input="local", gamma=gamma
    )
    rollout.compute_advantages(gamma, lam)
    v, r, adv = rollout.values, rollout.rewards, rollout.advantages

    def value_of(obs: list[float], agent: int) -> float:
        with torch.no_grad():
            return float(
                policy.critic_value(
                    torch.tensor([obs], dtype=torch.float32), None, torch.tensor([agent])
                )[0]
            )

    # a0 truncated at t=1: the next row shows its final observation, whose value is the
    # bootstrap; the accumulation stops there.
    assert float(v[2, 0]) == pytest.approx(value_of([0, 0, 2], 0), abs=1e-6)
    assert float(adv[1, 0]) == pytest.approx(float(r[1, 0] + gamma * v[2, 0] - v[1, 0]), abs=1e-5)
    # a1 terminated at t=2: no bootstrap.
    assert float(adv[2, 1]) == pytest.approx(float(r[2, 1] - v[2, 1]), abs=1e-5)
    # a2 truncated at t=3: the reset step's row holds V(final observation).
    assert float(v[4, 2]) == pytest.approx(value_of([2, 0, 4], 2), abs=1e-6)
    assert float(adv[3, 2]) == pytest.approx(float(r[3, 2] + gamma * v[4, 2] - v[3, 2]), abs=1e-5)
    # Mid-episode: the usual GAE recursion.
    delta = r[0, 0] + gamma * v[1, 0] - v[0, 0]
    assert float(adv[0, 0]) == pytest.approx(float(delta + gamma * lam * adv[1, 0]), abs=1e-5)
    collector.close()


def test_finished_agents_rows_contribute_nothing_to_the_update() -> None:
    """Garbage in every invalid row (dead agents, reset steps) leaves the update exactly
    as it was; the same garbage in one valid row does not (the test can fail)."""
    collector, policy, rollout, _ = scripted_rollout(14)
    collector.close()
    rollout.compute_advantages(0.9, 0.9)
    invalid = ~rollout.valid
    assert invalid.any() and rollout.valid.any()
    config = PPOConfig(learning_rate=1e-2, update_epochs=3, num_minibatches=2, anneal_lr=False)

    def updated(mutate: Any) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        mine, data = copy.deepcopy(policy), copy.deepcopy(rollout)
        mutate(data)
        metrics = PPOUpdate(mine, config, seed=3)(mine, data, 0.0)
        return mine.state_dict(), metrics

    def garbage(where: torch.Tensor) -> Any:
        def mutate(data: Rollout) -> None:
            g = torch.Generator().manual_seed(0)
            n = int(where.sum())
            data.obs[where] = torch.randn(n, 3, generator=g) * 1e3
            assert data.critic_obs is not None
            data.critic_obs[where] = torch.randn(n, data.critic_obs.shape[-1], generator=g)
            data.actions[where] = 1 - data.actions[where]
            data.logprob[where] = torch.randn(n, generator=g)
            data.values[where] = torch.randn(n, generator=g) * 1e3
            data.advantages[where] = torch.randn(n, generator=g) * 1e3
            data.returns[where] = torch.randn(n, generator=g) * 1e3

        return mutate

    reference, metrics = updated(lambda data: None)
    masked, masked_metrics = updated(garbage(invalid))
    for name, value in reference.items():
        assert torch.equal(value, masked[name]), name
    for key in ("loss_pi", "loss_v", "approx_kl", "entropy", "clip_fraction"):
        assert metrics[key] == masked_metrics[key], key
    one_valid = torch.zeros_like(invalid)
    one_valid[0, 0] = True
    changed, _ = updated(garbage(one_valid))
    assert any(not torch.equal(v, changed[k]) for k, v in reference.items())


def test_finished_agents_rows_stay_out_of_the_observation_statistics() -> None:
    collector, policy, rollout, _ = scripted_rollout(
        6,
        num_envs=1,
        policy_kwargs={"per_agent": True, "normalize_obs": True},
        endings="1:terminated,6:truncated",
    )
    collector.close()
    # a0 plays 1 step, a1 6 steps: 7 observations of agents playing; the other 5 rows are
    # a0's final observation again and again.
    assert int(rollout.valid.sum()) == 7
    assert policy.obs_normalizer is not None
    assert float(policy.obs_normalizer.count) == 7


# Per-agent actors: stacked weights equal a loop over separate networks.


def _copy_into_single(stacked: Policy, agent: int) -> Policy:
    single = Policy(stacked.spec, stacked.config)
    linears = [m for m in single.actor if isinstance(m, nn.Linear)]
    assert len(linears) == len(stacked.actor.layers)
    with torch.no_grad():
        for layer, linear in zip(stacked.actor.layers, linears, strict=True):
            assert isinstance(layer, StackedLinear)
            linear.weight.copy_(layer.weight[agent])
            linear.bias.copy_(layer.bias[agent])
        head = stacked.head.linear
        assert isinstance(head, StackedLinear)
        single.head.linear.weight.copy_(head.weight[agent])
        single.head.linear.bias.copy_(head.bias[agent])
        if hasattr(stacked.head, "log_std"):
            single.head.log_std.copy_(stacked.head.log_std[agent])
    return single


ACTION_SPACES = {
    "discrete": spaces.Discrete(5),
    "multidiscrete": spaces.MultiDiscrete([3, 4]),
    "box": spaces.Box(-1.0, 1.0, (2,)),
}


@pytest.mark.parametrize("kind", list(ACTION_SPACES))
def test_stacked_per_agent_actor_equals_a_loop_over_separate_actors(kind: str) -> None:
    torch.manual_seed(0)
    spec = SpaceSpec.from_spaces(spaces.Box(-5, 5, (6,)), ACTION_SPACES[kind])
    num_agents = 3
    stacked = Policy(
        spec, PolicyConfig(hidden_sizes=(8, 12), log_std_init=-0.3), num_agents=3, per_agent=True
    )
    with torch.no_grad():  # distinct log-stds per agent, so a mix-up would show
        if kind == "box":
            stacked.head.log_std.copy_(torch.randn_like(stacked.head.log_std))
        for p in stacked.head.linear.parameters():  # the 0.01-gain head is too flat to tell
            p.mul_(50.0)
    singles = [_copy_into_single(stacked, a) for a in range(num_agents)]
    obs = torch.randn(40, 6)
    agent = torch.randint(0, num_agents, (40,))
    agent[:3] = torch.tensor([2, 0, 1])
    params = stacked.dist_params(obs, None, agent)
    actions = stacked.head.sample(params, torch.Generator().manual_seed(1))
    logprob = stacked.head.log_prob(params, actions)
    for a, single in enumerate(singles):
        rows = agent == a
        expected = single.dist_params(obs[rows])
        torch.testing.assert_close(params[rows], expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(
            logprob[rows], single.head.log_prob(expected, actions[rows]), rtol=1e-5, atol=1e-5
        )
        torch.testing.assert_close(
            stacked.head.entropy(params[rows]), single.head.entropy(expected), rtol=1e-5, atol=1e-6
        )
    # The agents really differ: agent 0's network on agent 1's rows gives other outputs.
    rows = agent == 1
    assert not torch.allclose(params[rows], singles[0].dist_params(obs[rows]), atol=1e-4)


# Critic inputs.


def test_global_critic_input_is_the_env_state_for_mpe() -> None:
    rows = rows_env(SPREAD, 2)
    observed = rows.reset(seed=5)
    [group] = rows.groups
    assert rows.state_mode == "state" and group.critic_dim == 54
    rng = np.random.default_rng(0)
    for step in range(4):
        critic = observed[0].critic_obs
        assert critic is not None and critic.shape == (6, 54)
        for e, env in enumerate(rows.envs):
            state = np.asarray(env.state(), dtype=np.float32)
            for i in range(3):
                np.testing.assert_array_equal(critic[e * 3 + i], state, f"step {step}")
        # ... which here is every agent's observation, concatenated.
        np.testing.assert_allclose(critic[0], observed[0].obs[:3].reshape(-1), atol=1e-6)
        observed, _ = rows.step([torch.as_tensor(rng.integers(0, 5, 6))])
    rows.close()


@pytest.mark.parametrize("with_state", [False, True])
def test_global_critic_input_without_state_concatenates_observations(with_state: bool) -> None:
    rows = rows_env(SCRIPTED, 2, with_state=with_state)
    observed = rows.reset(seed=0)
    for _ in range(6):  # through agents finishing and an env reset
        [group] = rows.groups
        critic = observed[0].critic_obs
        assert critic is not None
        for e in range(2):
            if with_state:
                expected = rows.envs[e].state()
            else:
                expected = observed[0].obs[e * 3 : e * 3 + 3].reshape(-1)
            for i in range(3):
                np.testing.assert_array_equal(critic[e * 3 + i], expected)
        assert group.critic_dim == (2 if with_state else 9)
        observed, _ = rows.step([torch.zeros(6, dtype=torch.long)])
    rows.close()


@pytest.mark.parametrize("env_id", [SPREAD, SCRIPTED])
def test_agent_state_critic_input_is_the_global_state_then_the_own_observation(
    env_id: str, tmp_path: Path
) -> None:
    rows = rows_env(env_id, 2, critic_input="agent_state")
    glob = rows_env(env_id, 2)
    observed, expected = rows.reset(seed=3), glob.reset(seed=3)
    [group] = rows.groups
    state_dim = glob.groups[0].critic_dim
    assert state_dim is not None and group.critic_dim == state_dim + group.spec.obs_dim
    for step in range(6):  # SCRIPTED: through agents finishing and an env reset
        critic, obs = observed[0].critic_obs, observed[0].obs
        assert critic is not None and critic.shape == (6, state_dim + group.spec.obs_dim)
        np.testing.assert_array_equal(critic[:, :state_dim], expected[0].critic_obs, f"{step}")
        np.testing.assert_array_equal(critic[:, state_dim:], obs, f"step {step}")
        actions = [torch.as_tensor(np.arange(6) % 2)]
        (observed, _), (expected, _) = rows.step(actions), glob.step(actions)
    rows.close()
    glob.close()
    t = trainer(env_id, tmp_path, multiagent={"critic_input": "agent_state"})
    [policy] = t.policies
    assert policy.critic[0][0].in_features == group.critic_dim + 3
    t.collector.close()


@pytest.mark.parametrize("env_id", [SPREAD, SCRIPTED])
def test_agent_centric_critic_input_is_the_own_observation_then_the_others(
    env_id: str, tmp_path: Path
) -> None:
    rows = rows_env(env_id, 2, critic_input="agent_centric")
    observed = rows.reset(seed=4)
    [group] = rows.groups
    dim = group.spec.obs_dim
    assert group.critic_dim == 3 * dim
    for step in range(6):  # SCRIPTED: through agents finishing and an env reset
        critic, obs = observed[0].critic_obs, observed[0].obs
        assert critic is not None and critic.shape == (6, 3 * dim)
        for e in range(2):
            views = obs[e * 3 : e * 3 + 3]
            for i in range(3):
                others = [views[j] for j in range(3) if j != i]
                expected = np.concatenate([views[i], *others])
                np.testing.assert_array_equal(critic[e * 3 + i], expected, f"step {step}")
        (observed, _) = rows.step([torch.as_tensor(np.arange(6) % 2)])
    rows.close()
    t = trainer(env_id, tmp_path, multiagent={"critic_input": "agent_centric"})
    [policy] = t.policies
    assert policy.critic[0][0].in_features == 3 * dim + 3
    t.collector.close()


def test_local_critic_input_is_the_observation_plus_agent_id(tmp_path: Path) -> None:
    rows = rows_env(SPREAD, 2, critic_input="local")
    observed = rows.reset(seed=0)
    assert rows.groups[0].critic_dim is None and observed[0].critic_obs is None
    rows.close()
    t = trainer(SPREAD, tmp_path, multiagent={"critic_input": "local"})
    [policy] = t.policies
    assert t.collect().rollouts[0].critic_obs is None
    assert policy.critic[0][0].in_features == 18 + 3
    t.collector.close()


@pytest.mark.parametrize("per_agent", [False, True])
def test_agent_id_is_appended_to_the_critic_input(per_agent: bool) -> None:
    torch.manual_seed(0)
    spec = SpaceSpec.from_spaces(spaces.Box(-1, 1, (4,)), spaces.Discrete(3))
    policy = Policy(spec, SMALL, num_agents=3, per_agent=per_agent, agent_id=True, critic_dim=7)
    obs, critic_obs = torch.randn(9, 4), torch.randn(9, 7)
    agent = torch.arange(9) % 3
    one_hot = nn.functional.one_hot(agent, 3).float()
    with torch.no_grad():
        expected = policy.critic(torch.cat([critic_obs, one_hot], -1)).squeeze(-1)
        torch.testing.assert_close(policy.critic_value(obs, critic_obs, agent), expected)
        if per_agent:  # the stacked actor tells agents apart by its weights, not an input
            assert policy.actor.layers[0].weight.shape[-1] == 4
        else:
            features = policy.actor(torch.cat([obs, one_hot], -1))
            torch.testing.assert_close(
                policy.dist_params(obs, None, agent), policy.head.forward(features)
            )
    plain = Policy(spec, SMALL, num_agents=3, per_agent=per_agent, agent_id=False, critic_dim=7)
    assert plain.critic[0][0].in_features == 7


# Gradients: the critic loss reaches only the critic, the policy loss only the actor.


@pytest.mark.parametrize("per_agent", [False, True])
def test_gradient_isolation(per_agent: bool) -> None:
    torch.manual_seed(0)
    spec = SpaceSpec.from_spaces(spaces.Box(-1, 1, (4,)), spaces.Box(-1, 1, (2,)))
    policy = Policy(
        spec,
        SMALL,
        num_agents=3,
        per_agent=per_agent,
        agent_id=True,
        critic_dim=6,
        value_norm=True,
    )
    actor, critic = policy.actor_parameters(), policy.critic_parameters()
    assert {id(p) for p in actor}.isdisjoint(id(p) for p in critic)
    assert {id(p) for p in actor} | {id(p) for p in critic} == {id(p) for p in policy.parameters()}
    obs, critic_obs = torch.randn(12, 4), torch.randn(12, 6)
    agent = torch.arange(12) % 3

    policy.zero_grad(set_to_none=True)
    policy.value_raw(obs, critic_obs, agent).square().mean().backward()
    assert all(p.grad is None for p in actor)
    assert all(p.grad is not None for p in critic)

    policy.zero_grad(set_to_none=True)
    params = policy.dist_params(obs, None, agent)
    (policy.head.log_prob(params, torch.randn(12, 2)).mean() + params.square().mean()).backward()
    assert all(p.grad is None for p in critic)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in actor)

    if per_agent:
        # Agent 1's rows reach agent 1's slice of every stacked tensor, and no other.
        policy.zero_grad(set_to_none=True)
        rows = agent == 1
        params = policy.dist_params(obs[rows], None, agent[rows])
        (params + 1).square().sum().backward()
        for p in actor:
            assert p.grad is not None and p.shape[0] == 3
            assert p.grad[1].abs().sum() > 0
            assert p.grad[0].abs().sum() == 0 and p.grad[2].abs().sum() == 0


# Heterogeneous agents: one group (policy, rollout, update) per set of equal spaces.


def test_simple_tag_groups() -> None:
    rows = rows_env("mpe2:simple_tag_v3", 2)
    observed = rows.reset(seed=0)
    names = {g.name: g.agents for g in rows.groups}
    assert names == {
        "adversary": ("adversary_0", "adversary_1", "adversary_2"),
        "agent": ("agent_0",),
    }
    assert [o.obs.shape for o in observed] == [(6, 16), (2, 14)]
    rows.close()


def test_simple_adversary_two_groups_train(tmp_path: Path) -> None:
    t = trainer(
        "mpe2:simple_adversary_v3", tmp_path, total_steps=120, multiagent={"actor": "per_agent"}
    )
    assert [(g.name, g.agents, g.spec.obs_dim) for g in t.groups] == [
        ("adversary", ("adversary_0",), 8),
        ("agent", ("agent_0", "agent_1"), 10),
    ]
    assert [g.critic_dim for g in t.groups] == [28, 28]
    adversary, agents = t.policies
    assert not adversary.per_agent and agents.per_agent and agents.num_agents == 2
    assert {id(p) for p in adversary.parameters()}.isdisjoint(id(p) for p in agents.parameters())
    # Each group's update optimizes that group's parameters only.
    for update, policy in zip(t.updates, t.policies, strict=True):
        held = {
            id(p)
            for opt in update.optimizers.values()
            for g in opt.param_groups
            for p in g["params"]
        }
        assert held == {id(p) for p in policy.parameters()}
    assert [r.obs.shape for r in t.collect().rollouts] == [(30, 2, 8), (30, 4, 10)]
    policy = t.train()
    assert isinstance(policy, MultiAgentPolicy)
    rows = _progress(tmp_path)
    assert len(rows) == 2
    for row in rows:
        for metric in ("loss_pi", "loss_v", "approx_kl", "entropy", "stop_iter"):
            per_group = [float(row[f"{g}/{metric}"]) for g in ("adversary", "agent")]
            assert float(row[metric]) == pytest.approx(np.mean(per_group)), metric
        for agent in ("adversary_0", "agent_0", "agent_1"):
            assert math.isfinite(float(row[f"{agent}/episode_return"])), agent


# Continuous actions.


def test_continuous_actions_one_iteration(tmp_path: Path) -> None:
    t = trainer(
        SPREAD,
        tmp_path,
        total_steps=30,
        env={"num_envs": 2, "kwargs": {"continuous_actions": True}},
    )
    spec = t.groups[0].spec
    assert spec.action_kind == "box" and spec.action_shape == (5,)
    [rollout] = t.collect().rollouts
    assert rollout.actions.shape == (30, 6, 5)
    assert rollout.actions.dtype == torch.float32
    t.train()
    [row] = _progress(tmp_path)
    for metric in ("loss_pi", "loss_v", "approx_kl", "entropy", "episode_return_mean"):
        assert math.isfinite(float(row[metric])), metric


# Checkpoints, metrics.


def _progress(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "progress.csv").open(newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.mark.parametrize("actor", ["shared", "per_agent"])
def test_checkpoint_round_trip(tmp_path: Path, actor: str) -> None:
    t = trainer(
        SPREAD,
        tmp_path,
        eval_episodes=1,
        env={"num_envs": 2, "normalize_obs": True},
        multiagent={"actor": actor, "value_norm": True},
    )
    trained = t.train()
    assert isinstance(trained, MultiAgentPolicy)
    loaded = trustrl.load_policy(tmp_path)
    assert isinstance(loaded, MultiAgentPolicy)
    assert loaded.describe() == trained.describe()
    for name, value in trained.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[name]), name
    env = parallel_env_factory(SPREAD)()
    observations, _ = env.reset(seed=11)
    for _ in range(5):
        mine, theirs = trained.act(observations), loaded.act(observations)
        assert mine.keys() == theirs.keys() == set(env.agents)
        assert all(int(mine[a]) == int(theirs[a]) for a in mine)
        observations, *_ = env.step(mine)
    # Only the agents in the observation dict get actions.
    assert set(loaded.act({"agent_1": observations["agent_1"]})) == {"agent_1"}
    env.close()


def test_progress_and_tensorboard_have_per_agent_returns(tmp_path: Path) -> None:
    trainer(SPREAD, tmp_path).train()
    rows = _progress(tmp_path)
    columns = set(rows[0])
    for metric in (
        "loss_pi",
        "delta_loss_pi",
        "loss_v",
        "delta_loss_v",
        "approx_kl",
        "entropy",
        "clip_fraction",
        "stop_iter",
        "episode_return_mean",
    ):
        assert metric in columns, metric
    returns = []
    for agent in ("agent_0", "agent_1", "agent_2"):
        value = float(rows[0][f"{agent}/episode_return"])
        assert math.isfinite(value) and value < 0, agent
        returns.append(value)
    # The overall mean is over agents' episodes: equal counts, so the mean of the agents'.
    assert float(rows[0]["episode_return_mean"]) == pytest.approx(np.mean(returns))

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"agent_0/episode_return", "agent_2/episode_return", "loss_pi"} <= tags


def test_evaluate_parallel_mpe(tmp_path: Path) -> None:
    t = trainer(SPREAD, tmp_path)
    returns, lengths, _ = evaluate_parallel(t.policy, SPREAD, 2, seed=3)
    t.collector.close()
    assert lengths == [25, 25]
    assert all(r < 0 for r in returns)


def test_evaluate_parallel_with_agents_finishing_early() -> None:
    rows = rows_env(SCRIPTED, 1)
    rows.reset(seed=0)
    [group] = rows.groups
    rows.close()
    policy = MultiAgentPolicy([group], [Policy(group.spec, SMALL, num_agents=3, per_agent=True)])
    returns, lengths, _ = evaluate_parallel(policy, SCRIPTED, 2)
    per_agent = [
        sum(scripted_reward(i, 0, k) for k in range(1, n + 1)) for i, n in enumerate(LENGTHS)
    ]
    assert returns == [np.mean(per_agent)] * 2
    assert lengths == [4, 4]


def test_value_norm_predicts_standardized_returns() -> None:
    spec = SpaceSpec.from_spaces(spaces.Box(-1, 1, (4,)), spaces.Discrete(3))
    policy = Policy(spec, SMALL, num_agents=2, agent_id=True, value_norm=True)
    returns = torch.tensor([10.0, 20.0, 30.0, 40.0])
    targets, _ = policy.value_targets(returns, returns.clone())
    norm = policy.value_normalizer
    assert norm is not None and float(norm.mean) == pytest.approx(25.0)
    torch.testing.assert_close(targets, (returns - 25.0) / math.sqrt(125.0), rtol=1e-5, atol=1e-5)
    obs, agent = torch.randn(4, 4), torch.tensor([0, 1, 0, 1])
    with torch.no_grad():
        raw = policy.value_raw(obs, None, agent)
        torch.testing.assert_close(
            policy.critic_value(obs, None, agent), raw * math.sqrt(125.0) + 25.0
        )


# Registering agents while training.


def _fake_rollout(policy: Policy, num_envs: int, steps: int = 16, seed: int = 0) -> Rollout:
    g = torch.Generator().manual_seed(seed)
    spec, agents = policy.spec, policy.num_agents
    rollout = Rollout(
        steps,
        num_envs * agents,
        spec.obs_dim,
        spec.action_shape,
        spec.action_dtype,
        None,
        policy.critic_dim,
        agents,
    )
    for t in range(steps):
        obs = torch.randn(num_envs * agents, spec.obs_dim, generator=g)
        critic = (
            torch.randn(num_envs * agents, policy.critic_dim, generator=g)
            if policy.critic_dim
            else None
        )
        actions, logprob, value = policy.step(obs, None, g, critic, rollout.agent)
        rollout.obs[t], rollout.actions[t], rollout.logprob[t], rollout.values[t] = (
            obs,
            actions,
            logprob,
            value,
        )
        if critic is not None:
            assert rollout.critic_obs is not None
            rollout.critic_obs[t] = critic
        rollout.rewards[t] = torch.randn(num_envs * agents, generator=g)
    rollout.valid[:] = True
    rollout.compute_advantages(0.99, 0.95)
    return rollout


@pytest.mark.parametrize("mode", ["per_agent", "shared_id"])
def test_register_agent_keeps_existing_agents_and_gives_the_new_one_an_actor(mode: str) -> None:
    torch.manual_seed(0)
    spec = SpaceSpec.from_spaces(spaces.Box(-1, 1, (5,)), spaces.Discrete(4))
    policy = Policy(
        spec, SMALL, num_agents=2, per_agent=mode == "per_agent", agent_id=True, critic_dim=6
    )
    with torch.no_grad():
        for p in policy.head.parameters():
            p.mul_(50.0)
    config = PPOConfig(pi_lr=3e-3, vf_lr=3e-3, update_epochs=3, num_minibatches=2)
    update = PPOUpdate(policy, config)
    update(policy, _fake_rollout(policy, 3), 0.0)  # Adam moments now exist
    obs, critic_obs = torch.randn(8, 5), torch.randn(8, 6)
    old_agents = torch.tensor([0, 1, 1, 0, 0, 1, 0, 1])
    with torch.no_grad():
        before = (
            policy.dist_params(obs, None, old_agents),
            policy.critic_value(obs, critic_obs, old_agents),
        )
    moments = {
        id(p): {k: v.clone() for k, v in update.optimizers[key].state[p].items()}
        for key in update.optimizers
        for g in update.optimizers[key].param_groups
        for p in g["params"]
    }
    names = {id(p): n for n, p in policy.named_parameters()}

    grown = policy.register_agent()
    update.register_agent(grown)

    assert policy.num_agents == 3
    assert grown, "register_agent grew nothing"
    with torch.no_grad():
        after = (
            policy.dist_params(obs, None, old_agents),
            policy.critic_value(obs, critic_obs, old_agents),
        )
        new = torch.full((8,), 2)
        params = policy.dist_params(obs, None, new)
    # Equal to float32 rounding, not bit for bit: the stacked layer's one matmul now has
    # 3 agents' columns, and BLAS may block a wider matmul differently (1 ulp on AMD EPYC).
    torch.testing.assert_close(after[0], before[0])
    torch.testing.assert_close(after[1], before[1])
    assert params.shape == (8, 4) and torch.isfinite(params).all()
    assert torch.allclose(params.exp().sum(-1), torch.ones(8))
    if mode == "per_agent":
        # The new agent's actor is its own: its outputs differ from both old agents'.
        for a in (0, 1):
            with torch.no_grad():
                other = policy.dist_params(obs, None, torch.full((8,), a))
            assert not torch.allclose(params, other, atol=1e-4)
        assert policy.actor.layers[0].weight.shape[0] == 3
    else:
        assert policy.actor[0].weight.shape[-1] == 5 + 3
    assert policy.critic[0][0].weight.shape[-1] == 6 + 3

    # The optimizers hold the grown parameters; old moments kept, new entries zero.
    held = {
        id(p) for opt in update.optimizers.values() for g in opt.param_groups for p in g["params"]
    }
    assert held == {id(p) for p in policy.parameters()}
    for old, new_param, dim in grown:
        assert new_param.shape[dim] == old.shape[dim] + 1
        opt = next(
            o
            for o in update.optimizers.values()
            if any(p is new_param for g in o.param_groups for p in g["params"])
        )
        state = opt.state[new_param]
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].shape == new_param.shape, names.get(id(old))
            kept = state[key].narrow(dim, 0, old.shape[dim])
            torch.testing.assert_close(kept, moments[id(old)][key], rtol=0, atol=0)
            assert not state[key].narrow(dim, old.shape[dim], 1).any()

    # Training goes on with three agents' rows.
    metrics = update(policy, _fake_rollout(policy, 3, seed=1), 0.0)
    assert math.isfinite(metrics["loss_pi"]) and math.isfinite(metrics["loss_v"])
    state_dict = policy.state_dict()
    rebuilt = Policy.from_description(policy.describe())
    rebuilt.load_state_dict(state_dict)
    with torch.no_grad():
        torch.testing.assert_close(
            rebuilt.dist_params(obs, None, new), policy.dist_params(obs, None, new)
        )


def test_advantages_are_normalized_over_the_groups_valid_rows() -> None:
    """One minibatch: an affine change of the valid rows' advantages changes nothing."""
    collector, policy, rollout, _ = scripted_rollout(14)
    collector.close()
    rollout.compute_advantages(0.9, 0.9)
    config = PPOConfig(learning_rate=1e-2, update_epochs=3, num_minibatches=1, anneal_lr=False)
    results = []
    for scale, shift in ((1.0, 0.0), (3.0, -7.0)):
        mine, data = copy.deepcopy(policy), copy.deepcopy(rollout)
        data.advantages = torch.where(data.valid, data.advantages * scale + shift, data.advantages)
        PPOUpdate(mine, config, seed=3)(mine, data, 0.0)
        results.append(mine.actor_parameters())
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_simple_spread_kernel_preset_has_the_seed_kernels_settings() -> None:
    config = trustrl.resolve(SPREAD, preset="relayrl-kernel")
    assert config.total_steps == 2_000_000
    assert config.env.kwargs == {"local_ratio": 0.5, "max_cycles": 25, "continuous_actions": False}
    assert config.policy.hidden_sizes == (64, 64) and config.policy.activation == "relu"
    ppo = config.ppo
    assert (ppo.pi_lr, ppo.vf_lr, ppo.separate_optimizers) == (3e-4, 1e-3, True)
    assert (ppo.update_epochs, ppo.vf_epochs, ppo.num_minibatches) == (80, 80, 1)
    assert (ppo.clip_coef, ppo.target_kl, ppo.ent_coef, ppo.anneal_lr) == (0.2, 0.015, 0.0, False)
    assert (config.rollout.gamma, config.rollout.gae_lambda) == (0.99, 0.97)
    assert (config.multiagent.actor, config.multiagent.critic_input) == ("per_agent", "global")


@pytest.mark.parametrize("actor", ["shared", "per_agent"])
def test_paused_and_resumed_run_equals_an_uninterrupted_one(tmp_path: Path, actor: str) -> None:
    """The coop env pickles, so with its pickle trusted its episodes in flight resume
    exactly."""

    def make(run_dir: Path, resume: bool = False) -> Trainer:
        config = config_from_dict(
            table(
                "tests.coop_env:CoopCueEnv",
                run_dir,
                total_steps=4 * 2 * 24,
                env={"num_envs": 2, "normalize_obs": True, "normalize_reward": True},
                rollout={"num_steps": 24},
                multiagent={"actor": actor, "value_norm": True},
            )
        )
        return Trainer(config, resume=resume, trust_env_state=resume)

    straight = make(tmp_path / "a").train()
    make(tmp_path / "b").train(iterations=2)
    with pytest.warns(UserWarning, match="--trust-env-state"):
        resumed_trainer = make(tmp_path / "b", resume=True)
    assert resumed_trainer.envs_restored
    resumed = resumed_trainer.train()
    for name, value in straight.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name
    columns = ("loss_pi", "loss_v", "episode_return_mean", "agent_2/episode_return")
    for a, b in zip(_progress(tmp_path / "a"), _progress(tmp_path / "b"), strict=True):
        assert [a[c] for c in columns] == [b[c] for c in columns]


def test_a_multiagent_policy_in_the_wrong_env_or_with_wrong_shapes(tmp_path: Path) -> None:
    from trustrl.run.evaluation import evaluate

    policy = trainer(SPREAD, tmp_path / "run").policy
    assert isinstance(policy, MultiAgentPolicy)
    with pytest.raises(ValueError, match=r"which mpe2:simple_tag_v3 does not have \(its agents: "):
        evaluate(policy, "mpe2:simple_tag_v3", episodes=1)
    with pytest.raises(ValueError, match=r"agent_0: expected one observation of shape \(18,\)"):
        policy.act({"agent_0": np.zeros((2, 18), np.float32)})
    with pytest.raises(
        ValueError, match=r"expects observations of shape \(18,\).*got shape \(4,\)"
    ):
        policy.act({"agent_0": np.zeros(4, np.float32)})
