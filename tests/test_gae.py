"""GAE and the rollout buffer against an independent brute-force reference.

The reference sums (gamma * lambda)^k * delta_{t+k} over the rest of row t's episode in
plain Python floats, with the bootstrap rules written out per step: a terminated step has
no bootstrap, a truncated step bootstraps from next_values[t] (the value of the final
observation), and both end the sum.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from trustrl.learner.rollout import Batch, Rollout, gae


def reference_gae(rewards, values, next_values, terminated, truncated, gamma, lam):
    """(advantages, returns) as nested lists [t][i], by brute force over each episode."""
    rewards, values, next_values = rewards.tolist(), values.tolist(), next_values.tolist()
    terminated, truncated = terminated.tolist(), truncated.tolist()
    steps, rows = len(rewards), len(rewards[0])

    def delta(s: int, i: int) -> float:
        bootstrap = 0.0 if terminated[s][i] else gamma * next_values[s][i]
        return rewards[s][i] + bootstrap - values[s][i]

    advantages = [[0.0] * rows for _ in range(steps)]
    for t, i in itertools.product(range(steps), range(rows)):
        total = 0.0
        for s in range(t, steps):
            total += (gamma * lam) ** (s - t) * delta(s, i)
            if terminated[s][i] or truncated[s][i]:
                break
        advantages[t][i] = total
    returns = [
        [a + v for a, v in zip(ar, vr, strict=True)]
        for ar, vr in zip(advantages, values, strict=True)
    ]
    return advantages, returns


def random_inputs(steps: int, rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (steps, rows)
    rewards = torch.randn(shape, generator=g, dtype=torch.float64)
    values = torch.randn(shape, generator=g, dtype=torch.float64)
    next_values = torch.randn(shape, generator=g, dtype=torch.float64)
    zeros = torch.zeros(shape, dtype=torch.float64)
    return rewards, values, next_values, zeros.clone(), zeros.clone()


def check_against_reference(rewards, values, next_values, terminated, truncated, gamma, lam):
    advantages, returns = gae(rewards, values, next_values, terminated, truncated, gamma, lam)
    ref_adv, ref_ret = reference_gae(
        rewards, values, next_values, terminated, truncated, gamma, lam
    )
    expected_adv = torch.tensor(ref_adv, dtype=torch.float64)
    expected_ret = torch.tensor(ref_ret, dtype=torch.float64)
    torch.testing.assert_close(advantages, expected_adv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(returns, expected_ret, rtol=1e-12, atol=1e-12)
    return advantages, returns


STEPS, ROWS = 6, 3


@pytest.mark.parametrize("kind", ["terminated", "truncated", "both"])
@pytest.mark.parametrize("position", range(STEPS))
def test_boundary_at_every_position(kind: str, position: int) -> None:
    rewards, values, next_values, terminated, truncated = random_inputs(STEPS, ROWS, position)
    # Env 0: the boundary at `position`; env 1: the same at the mirrored position and one
    # more two steps later where it fits; env 2: no boundary at all (bootstraps at the end).
    marks = {"terminated": [terminated], "truncated": [truncated], "both": [terminated, truncated]}
    for flags in marks[kind]:
        flags[position, 0] = 1.0
        flags[STEPS - 1 - position, 1] = 1.0
        if STEPS - 1 - position + 2 < STEPS:
            flags[STEPS - 1 - position + 2, 1] = 1.0
    check_against_reference(rewards, values, next_values, terminated, truncated, 0.9, 0.8)


@pytest.mark.parametrize("position", range(STEPS))
def test_boundary_row_closed_form(position: int) -> None:
    """At the boundary step itself only one delta counts, whatever comes after."""
    rewards, values, next_values, terminated, truncated = random_inputs(STEPS, 1, 10 + position)
    gamma, lam = 0.9, 0.7

    terminated[position, 0] = 1.0
    adv, _ = gae(rewards, values, next_values, terminated, truncated, gamma, lam)
    expected = rewards[position, 0] - values[position, 0]
    assert adv[position, 0].item() == pytest.approx(expected.item(), abs=1e-12)

    terminated.zero_()
    truncated[position, 0] = 1.0
    adv, _ = gae(rewards, values, next_values, terminated, truncated, gamma, lam)
    expected = rewards[position, 0] + gamma * next_values[position, 0] - values[position, 0]
    assert adv[position, 0].item() == pytest.approx(expected.item(), abs=1e-12)


def test_terminated_and_truncated_differ_only_in_bootstrap() -> None:
    rewards, values, next_values, terminated, truncated = random_inputs(5, 1, 3)
    gamma, lam = 0.95, 0.9
    terminated[2, 0] = 1.0
    adv_term, _ = gae(rewards, values, next_values, terminated, truncated, gamma, lam)
    terminated.zero_()
    truncated[2, 0] = 1.0
    adv_trunc, _ = gae(rewards, values, next_values, terminated, truncated, gamma, lam)
    # Rows after the boundary do not see it at all.
    torch.testing.assert_close(adv_term[3:], adv_trunc[3:], rtol=0, atol=0)
    # Rows up to it differ by the discounted bootstrap gamma * V(final obs).
    for t in range(3):
        shift = (gamma * lam) ** (2 - t) * gamma * next_values[2, 0]
        assert (adv_trunc[t, 0] - adv_term[t, 0]).item() == pytest.approx(shift.item(), abs=1e-12)


def test_hand_computed_example() -> None:
    # One env, three steps, truncation at t=1 with V(final obs) = 4, gamma = 0.5, lambda = 1.
    rewards = torch.tensor([[1.0], [1.0], [2.0]], dtype=torch.float64)
    values = torch.tensor([[0.5], [1.0], [3.0]], dtype=torch.float64)
    next_values = torch.tensor([[1.0], [4.0], [6.0]], dtype=torch.float64)
    terminated = torch.zeros_like(rewards)
    truncated = torch.tensor([[0.0], [1.0], [0.0]], dtype=torch.float64)
    adv, ret = gae(rewards, values, next_values, terminated, truncated, 0.5, 1.0)
    # t=2: 2 + 0.5 * 6 - 3 = 2; t=1: 1 + 0.5 * 4 - 1 = 2 (stops); t=0: (1 + 0.5 - 0.5) + 0.5 * 2.
    torch.testing.assert_close(adv, torch.tensor([[2.0], [2.0], [2.0]], dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor([[2.5], [3.0], [5.0]], dtype=torch.float64))


@pytest.mark.parametrize(("gamma", "lam"), [(0.0, 0.0), (0.0, 1.0), (1.0, 0.0), (1.0, 1.0)])
def test_gamma_lambda_edges(gamma: float, lam: float) -> None:
    rewards, values, next_values, terminated, truncated = random_inputs(7, 2, 5)
    terminated[2, 0] = 1.0
    truncated[4, 1] = 1.0
    truncated[6, 0] = 1.0
    adv, _ = check_against_reference(
        rewards, values, next_values, terminated, truncated, gamma, lam
    )
    if gamma == 0.0:
        # No future at all: the advantage is r - V.
        torch.testing.assert_close(adv, rewards - values, rtol=0, atol=1e-12)
    elif lam == 0.0:
        # One-step TD error.
        expected = rewards + gamma * next_values * (1 - terminated) - values
        torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)


def test_lambda_one_is_monte_carlo_with_bootstrap() -> None:
    """lambda = 1: returns are discounted reward sums to the episode end plus, when the
    episode was cut (truncation or the end of the rollout), the discounted bootstrap."""
    steps, gamma = 8, 0.9
    rewards, values, next_values, terminated, truncated = random_inputs(steps, 2, 7)
    # Telescoping needs consistent values: next_values[t] = values[t + 1] inside an episode
    # (at a boundary next_values is V(final obs), which is what values[t + 1] holds too).
    next_values[:-1] = values[1:]
    terminated[3, 0] = 1.0
    truncated[5, 1] = 1.0
    _, ret = gae(rewards, values, next_values, terminated, truncated, gamma, 1.0)
    for i in range(2):
        for t in range(steps):
            end = next(
                (s for s in range(t, steps) if terminated[s, i] or truncated[s, i]), steps - 1
            )
            total = sum(gamma ** (s - t) * rewards[s, i].item() for s in range(t, end + 1))
            if not terminated[end, i]:
                total += gamma ** (end - t + 1) * next_values[end, i].item()
            assert ret[t, i].item() == pytest.approx(total, abs=1e-10)


def test_many_envs_random_boundaries_float32() -> None:
    g = torch.Generator().manual_seed(11)
    steps, rows = 16, 9
    rewards = torch.randn(steps, rows, generator=g)
    values = torch.randn(steps, rows, generator=g)
    next_values = torch.randn(steps, rows, generator=g)
    terminated = (torch.rand(steps, rows, generator=g) < 0.15).float()
    truncated = (torch.rand(steps, rows, generator=g) < 0.15).float()
    adv, ret = gae(rewards, values, next_values, terminated, truncated, 0.99, 0.95)
    assert adv.dtype == torch.float32 and adv.shape == (steps, rows)
    ref_adv, _ = reference_gae(rewards, values, next_values, terminated, truncated, 0.99, 0.95)
    torch.testing.assert_close(adv, torch.tensor(ref_adv), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret, adv + values, rtol=0, atol=0)


def test_returns_are_advantages_plus_values() -> None:
    rewards, values, next_values, terminated, truncated = random_inputs(5, 4, 9)
    terminated[1, 2] = 1.0
    truncated[3, 0] = 1.0
    adv, ret = gae(rewards, values, next_values, terminated, truncated, 0.97, 0.9)
    torch.testing.assert_close(ret, adv + values, rtol=0, atol=0)


def test_inputs_are_not_modified() -> None:
    inputs = random_inputs(4, 2, 13)
    inputs[3][1, 0] = 1.0
    copies = [x.clone() for x in inputs]
    gae(*inputs, 0.9, 0.9)
    for x, c in zip(inputs, copies, strict=True):
        assert torch.equal(x, c)


# Rollout: next_values from the buffer, and the flat gather of valid rows.


def filled_rollout(steps: int = 5, rows: int = 3, mask_dim: int | None = None) -> Rollout:
    g = torch.Generator().manual_seed(21)
    rollout = Rollout(steps, rows, 2, (), np.int64, mask_dim=mask_dim)
    rollout.obs = torch.randn(steps, rows, 2, generator=g)
    rollout.actions = torch.randint(0, 4, (steps, rows), generator=g)
    rollout.logprob = torch.randn(steps, rows, generator=g)
    rollout.values = torch.randn(steps, rows, generator=g)
    rollout.rewards = torch.randn(steps, rows, generator=g)
    rollout.last_value = torch.randn(rows, generator=g)
    rollout.valid = torch.ones(steps, rows, dtype=torch.bool)
    if mask_dim is not None:
        rollout.action_mask = torch.rand(steps, rows, mask_dim, generator=g) < 0.7
    return rollout


def test_compute_advantages_uses_next_row_values_and_last_value() -> None:
    rollout = filled_rollout()
    steps, rows = rollout.num_steps, rollout.num_rows
    # Env 0 truncates at t=1 (row 2 is its reset row), env 1 terminates at t=3, env 2
    # truncates on the last step (bootstrap = last_value).
    rollout.truncated[1, 0] = 1.0
    rollout.valid[2, 0] = False
    rollout.terminated[3, 1] = 1.0
    rollout.valid[4, 1] = False
    rollout.truncated[4, 2] = 1.0
    gamma, lam = 0.9, 0.8
    rollout.compute_advantages(gamma, lam)

    next_values = torch.empty(steps, rows)
    for t in range(steps):
        next_values[t] = rollout.values[t + 1] if t + 1 < steps else rollout.last_value
    ref_adv, ref_ret = reference_gae(
        rollout.rewards,
        rollout.values,
        next_values,
        rollout.terminated,
        rollout.truncated,
        gamma,
        lam,
    )
    torch.testing.assert_close(rollout.advantages, torch.tensor(ref_adv), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rollout.returns, torch.tensor(ref_ret), rtol=1e-5, atol=1e-5)

    # The truncated row bootstraps from the reset row's value, V(final observation).
    expected = rollout.rewards[1, 0] + gamma * rollout.values[2, 0] - rollout.values[1, 0]
    assert rollout.advantages[1, 0].item() == pytest.approx(expected.item(), abs=1e-6)
    # Truncation on the last step bootstraps from last_value.
    expected = rollout.rewards[4, 2] + gamma * rollout.last_value[2] - rollout.values[4, 2]
    assert rollout.advantages[4, 2].item() == pytest.approx(expected.item(), abs=1e-6)
    # Termination: no bootstrap.
    expected = rollout.rewards[3, 1] - rollout.values[3, 1]
    assert rollout.advantages[3, 1].item() == pytest.approx(expected.item(), abs=1e-6)


def test_last_row_without_boundary_bootstraps_from_last_value() -> None:
    rollout = filled_rollout(steps=3, rows=1)
    rollout.compute_advantages(0.5, 0.0)
    expected = rollout.rewards[2, 0] + 0.5 * rollout.last_value[0] - rollout.values[2, 0]
    assert rollout.advantages[2, 0].item() == pytest.approx(expected.item(), abs=1e-6)
    rollout.last_value += 2.0
    rollout.compute_advantages(0.5, 0.0)
    assert rollout.advantages[2, 0].item() == pytest.approx(expected.item() + 1.0, abs=1e-6)


def test_flat_drops_invalid_rows_in_time_major_order() -> None:
    rollout = filled_rollout(mask_dim=4)
    invalid = [(0, 1), (2, 0), (2, 2), (4, 1)]
    for t, i in invalid:
        rollout.valid[t, i] = False
    rollout.terminated[1, 0] = 1.0
    rollout.compute_advantages(0.99, 0.95)
    batch = rollout.flat()

    kept = [
        (t, i)
        for t in range(rollout.num_steps)
        for i in range(rollout.num_rows)
        if (t, i) not in invalid
    ]
    assert isinstance(batch, Batch)
    assert len(batch) == len(kept) == rollout.num_steps * rollout.num_rows - len(invalid)
    ts = torch.tensor([t for t, _ in kept])
    rs = torch.tensor([i for _, i in kept])
    assert torch.equal(batch.obs, rollout.obs[ts, rs])
    assert torch.equal(batch.actions, rollout.actions[ts, rs])
    assert torch.equal(batch.logprob, rollout.logprob[ts, rs])
    assert torch.equal(batch.values, rollout.values[ts, rs])
    assert torch.equal(batch.advantages, rollout.advantages[ts, rs])
    assert torch.equal(batch.returns, rollout.returns[ts, rs])
    assert rollout.action_mask is not None and batch.action_mask is not None
    assert torch.equal(batch.action_mask, rollout.action_mask[ts, rs])
    assert batch.obs.shape == (len(kept), 2)
    assert batch.action_mask.shape == (len(kept), 4)

    # Indexing a batch indexes every field together.
    pick = torch.tensor([3, 0, 5])
    sub = batch[pick]
    assert len(sub) == 3
    assert torch.equal(sub.returns, batch.returns[pick])
    assert torch.equal(sub.obs, batch.obs[pick])
    assert sub.action_mask is not None and torch.equal(sub.action_mask, batch.action_mask[pick])


def test_flat_without_mask_and_all_valid() -> None:
    rollout = filled_rollout()
    rollout.compute_advantages(0.9, 0.9)
    batch = rollout.flat()
    assert batch.action_mask is None
    assert len(batch) == rollout.num_steps * rollout.num_rows
    assert torch.equal(batch.returns, rollout.returns.reshape(-1))


@pytest.mark.parametrize("count", [1, 3, 4])
def test_minibatches_cover_every_row_once(count: int) -> None:
    n = 10
    batch = Batch(
        obs=torch.arange(n, dtype=torch.float32)[:, None],
        actions=torch.arange(n),
        logprob=torch.zeros(n),
        values=torch.zeros(n),
        advantages=torch.arange(n, dtype=torch.float32),
        returns=torch.zeros(n),
    )
    parts = list(batch.minibatches(count, torch.Generator().manual_seed(0)))
    assert len(parts) == count
    rows = torch.cat([mb.actions for mb in parts])
    assert sorted(rows.tolist()) == list(range(n))
    for mb in parts:  # every field of a row stays together
        assert torch.equal(mb.obs[:, 0].long(), mb.actions)
        assert torch.equal(mb.advantages.long(), mb.actions)
    if count == 1:
        assert parts[0] is batch  # the whole batch, as it is
    # The numpy view of the batch splits into the same minibatches, over the same memory.
    arrays = list(batch.numpy().minibatches(count, torch.Generator().manual_seed(0)))
    assert [mb.actions.tolist() for mb in arrays] == [mb.actions.tolist() for mb in parts]
    assert all(isinstance(mb.obs, np.ndarray) for mb in arrays)
