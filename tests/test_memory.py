"""Recurrent policies (policy.memory): the numpy cells against torch's, the chunk layout,
the states a collector stores against the states its acting produced, the chunked,
padded and masked losses and gradients against a step-by-step recomputation, resume,
evaluation, and bad settings refused naming the field."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch

import trustrl
from tests.collecting import collect
from trustrl.acting.collector import Collector
from trustrl.acting.inference import Inference
from trustrl.acting.memory import NumpyCell, chunk_layout
from trustrl.config import ConfigError, PolicyConfig, PPOConfig, TRPOConfig
from trustrl.envs.spaces import SpaceSpec
from trustrl.learner.memory import Memory, Sequences
from trustrl.learner.policy import Policy
from trustrl.learner.rollout import SequenceBatch
from trustrl.learner.updates.grads import LossSettings, TorchGradients
from trustrl.learner.updates.ppo import PPOUpdate
from trustrl.learner.updates.trpo import TRPOUpdate
from trustrl.run.evaluation import evaluate
from trustrl.run.logging import read_progress

# float32 recurrences in another order of operations, over up to 300 steps.
TOLERANCE = 1e-4
KINDS = ["lstm", "gru"]


def masked_cartpole(**kwargs: Any) -> gym.Env:
    from examples.masked import cartpole

    return cartpole(**kwargs)


def _spec(action: gym.Space[Any] | None = None) -> SpaceSpec:
    box = gym.spaces.Box(-5.0, 5.0, (3,), np.float32)
    return SpaceSpec.from_spaces(box, action or gym.spaces.Discrete(3))


def _policy(kind: str, share: bool = False, action: gym.Space[Any] | None = None) -> Policy:
    torch.manual_seed(0)
    config = PolicyConfig(hidden_sizes=(8,), memory=kind, memory_size=5, share_encoder=share)
    return Policy(_spec(action), config, normalize_obs=True)


@pytest.mark.parametrize("kind", KINDS)
def test_numpy_cells_equal_torch_over_long_sequences(kind: str) -> None:
    torch.manual_seed(1)
    memory = Memory(kind, 6, 7)
    weights = {k: v.detach().numpy() for k, v in memory.state_dict().items()}
    cell = NumpyCell(kind, weights, "rnn.")
    x = torch.randn(300, 4, 6)
    state = torch.randn(4, memory.state_size) * 0.5
    with torch.no_grad():
        expected, final = memory(x, state)
    numpy_state = state.numpy()
    for t in range(len(x)):
        out, numpy_state = cell(x[t].numpy(), numpy_state)
        np.testing.assert_allclose(out, expected[t].numpy(), atol=TOLERANCE)
    np.testing.assert_allclose(numpy_state, final.numpy(), atol=TOLERANCE)


@pytest.mark.parametrize("kind", KINDS)
def test_per_agent_cells_equal_each_agents_own_torch_layer(kind: str) -> None:
    """Stacked per-agent cores (multiagent.actor = "per_agent"): each sequence through its
    agent's weights, in torch (StackedRNN) and numpy, equal to that agent's own nn.LSTM or
    nn.GRU holding the same weights."""
    torch.manual_seed(4)
    memory = Memory(kind, 5, 6, num_agents=3)
    weights = {k: v.detach().numpy() for k, v in memory.state_dict().items()}
    cell = NumpyCell(kind, weights, "rnn.")
    x = torch.randn(50, 4, 5)
    agent = torch.tensor([2, 0, 1, 2])
    state = torch.randn(4, memory.state_size) * 0.5
    with torch.no_grad():
        out, final = memory(x, state, agent=agent)
        for row, a in enumerate(agent.tolist()):
            own = Memory(kind, 5, 6)
            own.rnn.load_state_dict({k: v[a] for k, v in memory.rnn.state_dict().items()})
            expected, expected_final = own(x[:, row : row + 1], state[row : row + 1])
            torch.testing.assert_close(out[:, row : row + 1], expected, atol=1e-5, rtol=0)
            torch.testing.assert_close(final[row : row + 1], expected_final, atol=1e-5, rtol=0)
    numpy_state = state.numpy()
    for t in range(len(x)):
        numpy_out, numpy_state = cell(x[t].numpy(), numpy_state, agent.numpy())
        np.testing.assert_allclose(numpy_out, out[t].numpy(), atol=TOLERANCE)


@pytest.mark.parametrize("kind", KINDS)
def test_an_episode_start_inside_a_sequence_resets_its_state(kind: str) -> None:
    torch.manual_seed(2)
    memory = Memory(kind, 3, 4)
    x, state = torch.randn(10, 2, 3), torch.randn(2, memory.state_size)
    resets = torch.zeros(10, 2, dtype=torch.bool)
    resets[6, 1] = True
    with torch.no_grad():
        out, _ = memory(x, state, resets)
        # Row 1 from step 6 on is a fresh sequence from zeros; row 0 runs through.
        fresh, _ = memory(x[6:, 1:], torch.zeros(1, memory.state_size))
        whole, _ = memory(x, state)
    torch.testing.assert_close(out[6:, 1:], fresh)
    torch.testing.assert_close(out[:, 0], whole[:, 0])
    torch.testing.assert_close(out[:6, 1], whole[:6, 1])
    assert not torch.allclose(out[6:, 1], whole[6:, 1])


@pytest.mark.parametrize("per_agent", [False, True])
def test_the_gate_bias_starts_the_lstm_keeping_that_share_of_its_cell(per_agent: bool) -> None:
    # With zero input and h, an LSTM's step is c' = sigmoid(f's bias) * c (i * tanh(0) = 0):
    # policy.memory_gate_bias sets what the core keeps, on the torch and the numpy side.
    spec = SpaceSpec.from_spaces(
        gym.spaces.Box(-1.0, 1.0, (3,), np.float32), gym.spaces.Discrete(2)
    )
    for bias in (0.0, 2.0):
        config = PolicyConfig(hidden_sizes=(), memory="lstm", memory_size=4, memory_gate_bias=bias)
        policy = Policy(spec, config, num_agents=2, per_agent=per_agent)
        memory = policy.actor_memory
        assert memory is not None
        state = torch.cat([torch.zeros(2, 4), torch.ones(2, 4)], 1)  # h = 0, c = 1
        agent = torch.tensor([0, 1])
        _, after = memory(torch.zeros(1, 2, 3), state, agent=agent if per_agent else None)
        kept = 1.0 / (1.0 + math.exp(-bias))
        torch.testing.assert_close(after[:, 4:], torch.full((2, 4), kept))
        cell = Inference.of(policy).actor_memory
        assert cell is not None
        _, numpy_after = cell(np.zeros((2, 3), np.float32), state.numpy(), agent.numpy())
        np.testing.assert_allclose(numpy_after[:, 4:], kept, atol=1e-6)


def test_chunks_are_cut_at_episode_starts_and_every_length_steps() -> None:
    starts = np.zeros((10, 2), bool)
    starts[4, 0] = True
    starts[0, 1] = True
    rows, firsts, lengths = chunk_layout(starts, 3)
    assert list(zip(rows.tolist(), firsts.tolist(), lengths.tolist(), strict=True)) == [
        (0, 0, 3),
        (0, 3, 1),
        (0, 4, 3),
        (0, 7, 3),
        (1, 0, 3),
        (1, 3, 3),
        (1, 6, 3),
        (1, 9, 1),
    ]


def _collector(seed: int = 0, num_envs: int = 3, length: int = 8) -> Collector:
    envs = gym.vector.SyncVectorEnv(
        [lambda: gym.make("CartPole-v1", max_episode_steps=15) for _ in range(num_envs)],
        autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP,
    )
    return Collector(envs, seed, gamma=0.99, num_steps=40, sequence_length=length)


def _cartpole_policy(kind: str, share: bool = False, post: tuple[int, ...] = ()) -> Policy:
    torch.manual_seed(3)
    spec = SpaceSpec.from_spaces(
        gym.spaces.Box(-np.inf, np.inf, (4,), np.float32), gym.spaces.Discrete(2)
    )
    config = PolicyConfig(
        hidden_sizes=(8,),
        memory=kind,
        memory_size=6,
        share_encoder=share,
        post_memory_sizes=post,
    )
    return Policy(spec, config, normalize_obs=True)


def _replay(inference: Inference, obs: np.ndarray, starts: np.ndarray) -> tuple[Any, ...]:
    """The acting side's states and values, recomputed step by step over a rollout."""
    steps, rows, _ = obs.shape
    state = np.zeros((rows, inference.state_size), np.float32)
    states, values, outs = [], [], []
    for t in range(steps):
        state = np.where(starts[t][:, None], np.float32(0.0), state)
        states.append(state)
        _, out, value, state = inference.act_recurrent(obs[t], None, None, state)
        values.append(value)
        outs.append(out)
    return np.stack(states), np.stack(values), np.stack(outs)


# post: hidden layers after the core (policy.post_memory_sizes), on both sides.
@pytest.mark.parametrize(
    ("kind", "share", "post"),
    [("lstm", False, ()), ("gru", False, ()), ("lstm", True, ()), ("lstm", False, (7, 5))],
)
def test_stored_states_are_the_states_the_acting_side_produced(
    kind: str, share: bool, post: tuple[int, ...]
) -> None:
    policy = _cartpole_policy(kind, share, post)
    collector = _collector()
    inference = Inference.of(policy)
    first, _ = collect(collector, policy, 40)
    second, _ = collect(collector, policy, 40)
    for rollout in (first, second):
        assert rollout.starts is not None and rollout.states is not None
        starts = rollout.starts.numpy()
        ended = (rollout.terminated + rollout.truncated).numpy() > 0
        # An episode starts on the step after its reset step (the step after an end).
        assert (starts[2:] == ended[:-2]).all()
    # The first rollout starts fresh: its states are recomputable from zeros.
    obs = first.obs.numpy()
    starts = first.starts.numpy().copy()
    starts[0] = True
    states, values, _ = _replay(inference, obs, starts)
    rows, firsts, _ = chunk_layout(first.starts.numpy(), 8)
    np.testing.assert_allclose(first.states.numpy(), states[firsts, rows], atol=1e-6)
    np.testing.assert_allclose(first.values.numpy(), values, atol=1e-5)
    # The second continues the first's episodes: its first chunks start from the carried
    # state, which the replay of both rollouts gives.
    both = np.concatenate([obs, second.obs.numpy()])
    both_starts = np.concatenate([starts, second.starts.numpy()])
    states, _, _ = _replay(inference, both, both_starts)
    rows, firsts, _ = chunk_layout(second.starts.numpy(), 8)
    np.testing.assert_allclose(second.states.numpy(), states[40 + firsts, rows], atol=1e-5)
    # The bootstrap after the last step continues the state too.
    _, last_values, _ = _replay(
        inference, np.concatenate([both, collector.lanes[0].obs[None]]), np.zeros((81, 3), bool)
    )
    assert last_values.shape == (81, 3)


@pytest.mark.parametrize(
    ("kind", "share", "post"),
    [
        ("lstm", False, ()),
        ("gru", False, ()),
        ("gru", True, ()),
        ("gru", False, (7,)),
        ("lstm", True, (7,)),
    ],
)
def test_chunked_terms_at_the_acting_weights_equal_what_was_acted(
    kind: str, share: bool, post: tuple[int, ...]
) -> None:
    policy = _cartpole_policy(kind, share, post)
    collector = _collector(seed=4)
    collect(collector, policy, 40)
    rollout, _ = collect(collector, policy, 40)
    rollout.sequence_length = 8
    batch = rollout.chunks()
    assert isinstance(batch, SequenceBatch)
    assert int(batch.loss_rows.sum()) == int(rollout.valid.sum())
    with torch.no_grad():
        params = policy.dist_params(batch.obs, None, sequences=batch.sequences)
        logprob = policy.head.log_prob(params, batch.actions)
        values = policy.value_raw(batch.obs, sequences=batch.sequences)
    rows = batch.loss_rows
    torch.testing.assert_close(logprob[rows], batch.logprob[rows], atol=1e-5, rtol=0)
    torch.testing.assert_close(values[rows], batch.values[rows], atol=1e-5, rtol=0)


def _step_by_step_loss(policy: Policy, batch: SequenceBatch, settings: LossSettings) -> Any:
    """PPO's loss over the chunks recomputed one step at a time from the stored states."""
    from trustrl.learner.losses import policy_terms, value_terms

    length, chunks = batch.length, len(batch.state)
    logprobs, entropies, values = [], [], []
    for c in range(chunks):
        state = batch.state[c : c + 1]
        for step in range(length):
            row = c * length + step
            obs = batch.obs[row : row + 1]
            params = policy.dist_params(obs, None, sequences=Sequences(state, 1))
            value = policy.value_raw(obs, sequences=Sequences(state, 1))
            state = policy.step_memory(obs, state)[1]
            if batch.loss_rows[row]:
                logprobs.append(policy.head.log_prob(params, batch.actions[row : row + 1]))
                entropies.append(policy.head.entropy(params))
                values.append(value)
    rows = batch.loss_rows
    named = policy_terms(
        torch.cat(logprobs),
        batch.logprob[rows],
        batch.advantages[rows],
        torch.cat(entropies),
        0.2,
    )
    loss_v = value_terms(torch.cat(values), batch.values[rows], batch.returns[rows])["loss_v"]
    return named["loss_pi"] - settings.ent_coef * named["entropy"] + settings.vf_coef * loss_v


@pytest.mark.parametrize(("kind", "post"), [("lstm", ()), ("gru", ()), ("lstm", (7,))])
def test_chunked_loss_and_gradients_equal_step_by_step_recomputation(
    kind: str, post: tuple[int, ...]
) -> None:
    policy = _cartpole_policy(kind, post=post)
    collector = _collector(seed=5)
    collect(collector, policy, 40)
    rollout, _ = collect(collector, policy, 40)
    rollout.sequence_length = 8
    rollout.compute_advantages(0.99, 0.95)
    # Move the weights off the acting ones, so that the ratios are not all 1.
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    batch = rollout.chunks()
    settings = LossSettings(ent_coef=0.01)
    update = PPOUpdate(policy, PPOConfig(grad_backend="torch"))
    grads = TorchGradients(policy, settings, update.optimizers)
    terms, flat = grads.step(batch, fit_policy=True, fit_value=True, clip_coef=0.2)
    expected = flat["all"].clone()
    policy.zero_grad()
    loss = _step_by_step_loss(policy, batch, settings)
    loss.backward()
    reference = torch.cat([p.grad.reshape(-1) for p in policy.parameters()])
    torch.testing.assert_close(expected, reference, atol=1e-5, rtol=1e-4)
    assert math.isfinite(terms["loss_pi"])


@pytest.mark.parametrize("algo", ["ppo", "trpo"])
def test_updates_train_recurrent_policies_on_chunks(algo: str) -> None:
    policy = _cartpole_policy("lstm")
    collector = _collector(seed=6)
    rollout, _ = collect(collector, policy, 40)
    rollout.sequence_length = 8
    rollout.compute_advantages(0.99, 0.95)
    before = [p.detach().clone() for p in policy.parameters()]
    if algo == "ppo":
        metrics = PPOUpdate(policy, PPOConfig(num_minibatches=3))(policy, rollout, 0.0)
    else:
        metrics = TRPOUpdate(policy, TRPOConfig(minibatches=3))(policy, rollout, 0.0)
        assert metrics["line_search_accepted"] == 1.0
    assert math.isfinite(metrics["loss_pi"]) and math.isfinite(metrics["loss_v"])
    moved = [not torch.equal(a, b) for a, b in zip(before, policy.parameters(), strict=True)]
    assert all(moved)


def test_policy_act_carries_the_state_as_the_acting_side_does() -> None:
    policy = _cartpole_policy("gru")
    inference = Inference.of(policy)
    rng = np.random.default_rng(0)
    obs = rng.normal(size=(12, 2, 4)).astype(np.float32)
    state, numpy_state = None, np.zeros((2, inference.state_size), np.float32)
    norm = inference.obs_normalizer
    assert norm is not None
    for t in range(12):
        actions, state = policy.act(obs[t], state=state)
        expected, _, _, numpy_state = inference.act_recurrent(
            norm.normalize_array(obs[t]), None, None, numpy_state
        )
        np.testing.assert_array_equal(actions, expected)
        np.testing.assert_allclose(state, numpy_state, atol=TOLERANCE)
    # One observation at a time: an action and a state row.
    action, row = policy.act(obs[0, 0])
    assert np.shape(action) == () and row.shape == (policy.state_size,)


def _overrides(run_dir: Path, kind: str, total: int, **extra: Any) -> dict[str, Any]:
    return {
        "quiet": True,
        "total_steps": total,
        "eval_episodes": 0,
        "target_return": None,
        "checkpoint_every": 1000,
        "run_dir": str(run_dir),
        "env": {"backend": "sync", "num_envs": 2},
        "rollout": {"num_steps": 32, "sequence_length": 8},
        "policy": {"memory": kind, "memory_size": 8, "hidden_sizes": [16]},
        "ppo": {"num_minibatches": 2, "update_epochs": 2},
        **extra,
    }


def test_a_recurrent_run_resumes_bit_identically(tmp_path: Path) -> None:
    steps = 64 * 6
    whole = trustrl.Trainer(
        trustrl.resolve("CartPole-v1", overrides=_overrides(tmp_path / "a", "lstm", steps))
    )
    whole.train()
    config = trustrl.resolve("CartPole-v1", overrides=_overrides(tmp_path / "b", "lstm", steps))
    trustrl.Trainer(config).train(iterations=3)
    resumed = trustrl.Trainer(config, tmp_path / "b", resume=True)
    assert resumed.envs_restored
    resumed.train()
    rows_a = read_progress(tmp_path / "a" / "progress.csv")
    rows_b = read_progress(tmp_path / "b" / "progress.csv")
    for a, b in zip(rows_a, rows_b, strict=True):
        assert (
            a["loss_pi"] == b["loss_pi"] and a["episode_return_mean"] == b["episode_return_mean"]
        ) or (math.isnan(a["episode_return_mean"]) and math.isnan(b["episode_return_mean"]))
    for (name, x), y in zip(
        whole.policy.state_dict().items(), resumed.policy.state_dict().values(), strict=True
    ):
        assert torch.equal(x, y), name


def test_evaluation_carries_each_episodes_state(tmp_path: Path) -> None:
    """Evaluation acts in batches of episodes through the numpy side; the same policy
    stepped one episode at a time by Policy.act gives the same returns."""
    policy = _cartpole_policy("lstm")
    policy.obs_normalizer = None
    result = evaluate(policy, "CartPole-v1", episodes=3, seed=7)
    env = gym.make("CartPole-v1")
    for episode in range(3):
        obs, _ = env.reset(seed=7 + episode)
        state, total, done = None, 0.0, False
        while not done:
            action, state = policy.act(obs, state=state)
            obs, reward, terminated, truncated, _ = env.step(action)
            total += float(reward)
            done = terminated or truncated
        assert total == result.returns[episode]


def test_a_new_agent_gets_a_core_of_its_own_and_the_others_act_as_before() -> None:
    torch.manual_seed(5)
    spec = _spec()
    config = PolicyConfig(hidden_sizes=(8,), memory="lstm", memory_size=4)
    policy = Policy(spec, config, num_agents=2, per_agent=True)
    x = torch.randn(6, 3)
    agent = torch.tensor([0, 1, 0, 1, 0, 1])
    state = torch.randn(6, policy.state_size)
    with torch.no_grad():
        before = policy.dist_params(x, None, agent, sequences=Sequences(state, 1))
    policy.register_agent()
    assert policy.actor_memory is not None
    assert policy.actor_memory.rnn.weight_ih_l0.shape[0] == 3
    with torch.no_grad():
        after = policy.dist_params(x, None, agent, sequences=Sequences(state, 1))
        third = policy.dist_params(
            x[:1], None, torch.tensor([2]), sequences=Sequences(state[:1], 1)
        )
    torch.testing.assert_close(after, before)
    assert third.shape == (1, 3)


def test_bad_memory_settings_are_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"policy\.memory_size must be an integer >= 1, got 0"):
        PolicyConfig(memory="lstm", memory_size=0)
    with pytest.raises(ConfigError, match=r"policy\.memory must be one of none, lstm, gru"):
        PolicyConfig(memory="rnn")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"policy\.post_memory_sizes \[64\] needs a memory core"):
        PolicyConfig(post_memory_sizes=(64,))
    with pytest.raises(
        ConfigError, match=r"policy\.post_memory_sizes must be positive integers.*got \(0,\)"
    ):
        PolicyConfig(memory="gru", post_memory_sizes=(0,))
    with pytest.raises(ConfigError, match=r"rollout.sequence_length must be <= rollout.num_steps"):
        trustrl.resolve(
            "CartPole-v1",
            overrides={
                "rollout": {"num_steps": 16, "sequence_length": 32},
                "policy": {"memory": "gru"},
            },
        )
    config = PolicyConfig(memory="gru")
    # Without memory the sequence length is not checked (it has no effect).
    trustrl.resolve("CartPole-v1", overrides={"rollout": {"num_steps": 8}})
    assert replace(config, memory="none").memory == "none"


@pytest.mark.parametrize(("kind", "post"), [("lstm", []), ("gru", []), ("lstm", [16])])
def test_export_steps_the_state_and_matches_act_over_whole_episodes(
    tmp_path: Path, kind: str, post: list[int]
) -> None:
    import onnxruntime as ort

    from trustrl.run.checkpoint import load_policy
    from trustrl.run.export import export_policy

    overrides = _overrides(tmp_path / "run", kind, 64 * 4, eval_episodes=0)
    overrides["policy"]["post_memory_sizes"] = post
    config = trustrl.resolve("CartPole-v1", overrides=overrides)
    trustrl.Trainer(config).train()
    policy = load_policy(tmp_path / "run")
    assert isinstance(policy, Policy)
    onnx = export_policy(tmp_path / "run", "onnx")
    script = export_policy(tmp_path / "run", "torchscript")
    actor_state = policy.actor_memory.state_size  # type: ignore[union-attr]
    assert onnx.inputs == {"obs": "float32 (batch, 4)", "state": f"float32 (batch, {actor_state})"}
    assert set(onnx.outputs) == {"action", "next_state"}
    session = ort.InferenceSession(str(onnx.path), providers=["CPUExecutionProvider"])
    traced = torch.jit.load(str(script.path))
    env = gym.make("CartPole-v1")
    steps = 0
    for episode in range(2):
        obs, _ = env.reset(seed=episode)
        state = None
        onnx_state = np.zeros((1, actor_state), np.float32)
        script_state = torch.zeros(1, actor_state)
        done = False
        while not done:
            action, state = policy.act(obs, state=state)
            batch = np.asarray(obs, np.float32)[None]
            onnx_action, onnx_state = session.run(None, {"obs": batch, "state": onnx_state})
            script_action, script_state = traced(torch.from_numpy(batch), script_state)
            assert int(onnx_action[0]) == int(action) == int(script_action[0])
            np.testing.assert_allclose(onnx_state[0], state[:actor_state], atol=TOLERANCE)
            obs, _, terminated, truncated, _ = env.step(action)
            done = terminated or truncated
            steps += 1
    assert steps > 20
    # Any batch size: three rows at once, each its own state.
    rows = np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)
    actions, states = policy.act(rows)
    onnx_actions, onnx_states = session.run(
        None, {"obs": rows, "state": np.zeros((3, actor_state), np.float32)}
    )
    np.testing.assert_array_equal(onnx_actions, actions)
    np.testing.assert_allclose(onnx_states, states[:, :actor_state], atol=TOLERANCE)


# Multi-agent groups: one actor shared by the agents (with their ids), a global critic.


def _scripted_rollout(
    steps: int, per_agent: bool = False, post: tuple[int, ...] = ()
) -> tuple[Any, Policy, Any]:
    from tests.test_multiagent import SCRIPTED, rows_env

    collector = Collector(rows_env(SCRIPTED, 2, "global"), 0, 0.9, num_steps=steps)
    collector.sequence_length = 8
    group = collector.groups[0]
    torch.manual_seed(8)
    config = PolicyConfig(hidden_sizes=(8,), memory="gru", memory_size=6, post_memory_sizes=post)
    policy = Policy(
        group.spec,
        config,
        num_agents=group.num_agents,
        per_agent=per_agent,
        agent_id=True,
        critic_dim=group.critic_dim,
    )
    return collector, policy, group


@pytest.mark.parametrize(("per_agent", "post"), [(False, ()), (True, ()), (True, (7,))])
def test_multiagent_rows_start_where_their_agent_is_back_and_terms_match_acting(
    per_agent: bool, post: tuple[int, ...]
) -> None:
    collector, policy, _ = _scripted_rollout(30, per_agent, post)
    for _ in range(2):
        rollout, _ = collect(collector, policy, 30)
        assert rollout.starts is not None
        # The scripted env's observation is [agent, episode, step]: step 0 starts an
        # episode, and only there does a row's state reset (agents that finished early
        # wait, not alive, for the env's reset step).
        np.testing.assert_array_equal(rollout.starts.numpy(), rollout.obs[..., 2].numpy() == 0)
        rollout.sequence_length = 8
        batch = rollout.chunks()
        with torch.no_grad():
            params = policy.dist_params(batch.obs, None, batch.agent, sequences=batch.sequences)
            logprob = policy.head.log_prob(params, batch.actions)
            values = policy.value_raw(
                batch.obs, batch.critic_obs, batch.agent, sequences=batch.sequences
            )
        rows = batch.loss_rows
        assert int(rows.sum()) == int(rollout.valid.sum())
        torch.testing.assert_close(logprob[rows], batch.logprob[rows], atol=1e-5, rtol=0)
        torch.testing.assert_close(values[rows], batch.values[rows], atol=1e-5, rtol=0)


def test_mappo_with_memory_trains_resumes_and_evaluates(tmp_path: Path) -> None:
    from tests.test_multiagent import SCRIPTED, SPREAD, table
    from trustrl.config import config_from_dict
    from trustrl.learner.policy import MultiAgentPolicy
    from trustrl.run.evaluation import evaluate_parallel

    memory = {
        "policy": {"hidden_sizes": [16], "memory": "gru", "memory_size": 8},
        "rollout": {"num_steps": 30, "sequence_length": 10},
        "multiagent": {"actor": "shared", "agent_id": True, "critic_input": "agent_centric"},
        "total_steps": 240,
    }
    whole = trustrl.Trainer(config_from_dict(table(SPREAD, tmp_path / "a", **memory)))
    whole.train()
    config = config_from_dict(table(SPREAD, tmp_path / "b", **memory))
    trustrl.Trainer(config).train(iterations=2)
    resumed = trustrl.Trainer(config, tmp_path / "b", resume=True)
    resumed.train()
    for (name, x), y in zip(
        whole.policy.state_dict().items(), resumed.policy.state_dict().values(), strict=True
    ):
        if resumed.envs_restored:
            assert torch.equal(x, y), name
    policy = whole.policy
    assert isinstance(policy, MultiAgentPolicy) and policy.state_size
    returns, lengths, _ = evaluate_parallel(policy, SPREAD, 2)
    assert len(returns) == 2 and all(math.isfinite(r) for r in returns)
    # Agents that finish early keep their states apart from the others'.
    _, scripted_policy, group = _scripted_rollout(4)
    scripted = MultiAgentPolicy([group], [scripted_policy])
    returns, lengths, _ = evaluate_parallel(scripted, SCRIPTED, 2)
    assert lengths == [4, 4]


# External agents: Agent carries each episode's state, chunks carry their states.


def test_agents_carry_states_and_the_learner_trains_on_what_they_acted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import trustrl.run.trainer as trainer_module
    from tests.test_external import play_cartpole
    from trustrl.client.agent import Agent

    seen: list[Any] = []
    absorb = trainer_module.absorb

    def recording(policies: Any, batch: Any, *args: Any) -> Any:
        # At absorb time the learner's weights are still those of batch.version's snapshot
        # (the first batches: version 0 and on, one update each).
        rollouts = absorb(policies, batch, *args)
        policy = policies[0]
        for rollout in rollouts:
            chunks = rollout.chunks()
            with torch.no_grad():
                params = policy.dist_params(chunks.obs, None, sequences=chunks.sequences)
                logprob = policy.head.log_prob(params, chunks.actions)
                values = policy.value_raw(chunks.obs, sequences=chunks.sequences)
            rows = chunks.loss_rows
            seen.append(
                (
                    float((logprob[rows] - chunks.logprob[rows]).abs().max()),
                    float((values[rows] - chunks.values[rows]).abs().max()),
                )
            )
        return rollouts

    monkeypatch.setattr(trainer_module, "absorb", recording)
    overrides = {
        "quiet": True,
        "seed": 1,
        "total_steps": 3 * 64,
        "eval_episodes": 0,
        "env": {"num_envs": 2},
        "rollout": {"num_steps": 32, "sequence_length": 8},
        "policy": {"memory": "gru", "memory_size": 8, "hidden_sizes": [16]},
        "agent": {"max_chunk_length": 20},  # chunks cut mid-episode carry the state on
    }
    config = trustrl.resolve("CartPole-v1", overrides=overrides)
    agent = Agent.local(config, tmp_path / "run", seed=1)
    play_cartpole(agent, seed=1, max_steps=5_000)
    trainer = agent.learner
    agent.close()
    assert trainer.outcome == "finished", trainer.outcome
    assert len(seen) == 3
    # Agent.local's learner runs in step with its agent: every batch was acted with the
    # weights the learner holds when it takes it in, so the learner's recomputation from
    # the states the agent sent equals what the agent acted with.
    for logprob_gap, value_gap in seen:
        assert logprob_gap < 1e-5 and value_gap < 1e-5


def test_a_chunk_of_a_recurrent_policy_needs_its_states() -> None:
    from tests.test_external import chunk, group
    from trustrl.remote.external import learner_info
    from trustrl.remote.wire import ChunkError, decode_chunk, encode_chunk

    groups = [group()]
    memory = {"state_size": 12, "sequence_length": 4}
    plain = encode_chunk(chunk(10))
    with pytest.raises(ChunkError, match="states missing") as info:
        decode_chunk(plain, groups, memory=memory)
    assert info.value.reason == "missing_array"
    wrong = encode_chunk(replace(chunk(10), states=np.zeros((2, 12), np.float32)))
    with pytest.raises(ChunkError, match="states"):
        decode_chunk(wrong, groups, memory=memory)
    right = encode_chunk(replace(chunk(10), states=np.ones((3, 12), np.float32)))
    _, decoded = decode_chunk(right, groups, memory=memory)
    assert decoded.states is not None and decoded.states.shape == (3, 12)
    with pytest.raises(ChunkError, match="unknown arrays"):
        decode_chunk(right, groups)  # a learner without memory takes no states
    config = trustrl.resolve("CartPole-v1", overrides={"policy": {"memory": "lstm"}})
    assert learner_info(config, groups)["memory"] == {"state_size": 256, "sequence_length": 16}


def test_a_thin_agent_acting_with_the_gateways_onnx_model_is_replayed_exactly() -> None:
    """A thin agent feeds the gateway model's next_state back and sends the states at its
    chunk's sequence starts; the learner's replay gives the log-probabilities of the
    model's own params and the values the recurrent critic gives."""
    import onnxruntime as ort

    from trustrl.contract import PolicySnapshot
    from trustrl.remote import thin
    from trustrl.remote.gateway import onnx_model
    from trustrl.remote.wire import ChunkError

    policy = _cartpole_policy("lstm")
    snapshot = PolicySnapshot.of([policy], 0)
    model = onnx_model(snapshot)
    assert model, "a recurrent single-agent policy has a gateway model"
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    assert names == ["obs", "state"]
    every, length = 4, 10
    rng = np.random.default_rng(0)
    obs = rng.normal(size=(length + 1, 4)).astype(np.float32)  # a cut chunk's bootstrap row
    state = np.zeros((1, policy.state_size), np.float32)
    states, actions, log_probs = [], [], []
    for t in range(length):
        if t % every == 0:
            states.append(state[0].copy())
        _, params, state = session.run(None, {"obs": obs[t : t + 1], "state": state})
        action = int(rng.choice(2, p=np.exp(params[0]) / np.exp(params[0]).sum()))
        actions.append(action)
        log_probs.append(params[0, action])
    tensors = {
        "obs": obs,
        "actions": np.asarray(actions, np.int64),
        "rewards": np.ones(length, np.float32),
        "states": np.stack(states),
    }
    memory = {"state_size": policy.state_size, "sequence_length": every}
    assert thin.check_thin(tensors, policy.spec, "cut", 100, memory) == length
    too_few = {**tensors, "states": np.stack(states[:2])}
    with pytest.raises(ChunkError, match="states"):
        thin.check_thin(too_few, policy.spec, "cut", 100, memory)
    header = {"agent": "", "source": "s", "seq": 0, "version": 0, "ending": "cut", "sender": "t"}
    inference = Inference(snapshot.groups[0])
    chunk = thin.thicken(tensors, header, policy.spec, inference, 0, thin.Stream(None), 0.99, every)
    np.testing.assert_allclose(chunk.logprob, np.asarray(log_probs), atol=1e-5)
    # The values: the critic's core from the same states, the bootstrap from the state
    # after the last step.
    norm = inference.obs_normalizer
    assert norm is not None
    x = norm.normalize_array(obs)
    expected = []
    replay = np.zeros((1, policy.state_size), np.float32)
    for t in range(length):
        if t % every == 0:
            replay = np.stack(states)[t // every][None]
        _, _, value, replay = inference.act_recurrent(x[t : t + 1], None, None, replay)
        expected.append(value[0])
    expected.append(inference.value_recurrent(x[length:], replay)[0])
    np.testing.assert_allclose(chunk.values, np.asarray(expected), atol=1e-6)
    assert chunk.states is not None and chunk.states.shape == (3, policy.state_size)
