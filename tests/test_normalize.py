"""MeanStd and the policy's RunningMeanStd: merged batch statistics equal the statistics of
the concatenation."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from trustrl.learner.policy import RunningMeanStd
from trustrl.normalize import MeanStd

SIZES = [1, 7, 1, 64, 3, 1, 250, 2]


def random_batches(shape: tuple[int, ...], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    # Different batches from different distributions, so the merge term matters.
    return [
        rng.normal(loc=3.0 * k - 5.0, scale=0.5 + k, size=(n, *shape)) for k, n in enumerate(SIZES)
    ]


@pytest.mark.parametrize("shape", [(), (3,), (2, 2)])
def test_update_matches_numpy_over_concatenation(shape: tuple[int, ...]) -> None:
    rms = RunningMeanStd(shape)
    batches = random_batches(shape)
    for i, batch in enumerate(batches):
        rms.update(torch.from_numpy(batch))
        seen = np.concatenate(batches[: i + 1])
        np.testing.assert_allclose(rms.mean.numpy(), seen.mean(0), rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(rms.var.numpy(), seen.var(0, ddof=0), rtol=1e-10, atol=1e-10)
        assert rms.count.item() == len(seen)
    assert rms.mean.dtype == torch.float64 and rms.var.dtype == torch.float64
    assert rms.mean.shape == shape


def test_first_single_sample_gives_zero_variance() -> None:
    rms = RunningMeanStd(2)
    rms.update(torch.tensor([[1.5, -2.0]]))
    np.testing.assert_array_equal(rms.mean.numpy(), [1.5, -2.0])
    np.testing.assert_array_equal(rms.var.numpy(), [0.0, 0.0])
    rms.update(torch.tensor([[2.5, -4.0]]))
    np.testing.assert_allclose(rms.mean.numpy(), [2.0, -3.0])
    np.testing.assert_allclose(rms.var.numpy(), [0.25, 1.0])


def test_float32_input_and_empty_batch() -> None:
    rms = RunningMeanStd(3)
    data = np.random.default_rng(1).normal(size=(40, 3)).astype(np.float32)
    rms.update(torch.from_numpy(data[:25]))
    rms.update(torch.zeros((0, 3)))  # ignored
    rms.update(torch.from_numpy(data[25:]))
    assert rms.count.item() == 40
    reference = data.astype(np.float64)
    np.testing.assert_allclose(rms.mean.numpy(), reference.mean(0), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(rms.var.numpy(), reference.var(0), rtol=1e-10, atol=1e-12)


def test_forward_standardizes_and_clips() -> None:
    rms = RunningMeanStd(2, clip=3.0, epsilon=1e-8)
    rms.update(torch.tensor([[0.0, 10.0], [2.0, 30.0]]))  # mean (1, 20), var (1, 100)
    x = torch.tensor([[1.0, 20.0], [2.0, 25.0], [1.0, 45.0], [-9.0, -100.0]])
    out = rms(x)
    expected = torch.tensor([[0.0, 0.0], [1.0, 0.5], [0.0, 2.5], [-3.0, -3.0]])
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert out.dtype == torch.float32
    # Unclipped values follow (x - mean) / sqrt(var + eps) exactly.
    rms_wide = RunningMeanStd(2, clip=1e9, epsilon=0.5)
    rms_wide.load_state_dict(rms.state_dict())
    expected_wide = (x.double() - torch.tensor([1.0, 20.0])) / torch.sqrt(
        torch.tensor([1.0, 100.0]) + 0.5
    )
    torch.testing.assert_close(rms_wide(x), expected_wide.float(), rtol=1e-6, atol=1e-6)


def test_scale_divides_only() -> None:
    rms = RunningMeanStd((), clip=5.0, epsilon=0.0)
    rms.update(torch.tensor([10.0, 14.0]))  # mean 12, var 4 -> std 2
    x = torch.tensor([4.0, -3.0, 0.0, 12.0, 100.0])
    # No mean subtraction: 12 scales to 6, clipped to 5; the sign is kept.
    np.testing.assert_allclose(rms.numpy.scale_array(x.numpy()), [2.0, -1.5, 0.0, 5.0, 5.0])
    torch.testing.assert_close(rms(x), torch.tensor([-4.0, -5.0, -5.0, 0.0, 5.0]))


def test_fresh_normalizer_is_identity_up_to_clip() -> None:
    rms = RunningMeanStd(3, clip=10.0)
    x = torch.tensor([[0.5, -2.0, 30.0]])
    torch.testing.assert_close(rms(x), torch.tensor([[0.5, -2.0, 10.0]]), rtol=1e-6, atol=1e-6)


def test_state_dict_round_trip() -> None:
    rms = RunningMeanStd(4)
    for batch in random_batches((4,), seed=3):
        rms.update(torch.from_numpy(batch))
    state = rms.state_dict()
    assert set(state) == {"mean", "var", "count"}

    restored = RunningMeanStd(4)
    restored.load_state_dict(state)
    for name in ("mean", "var", "count"):
        assert torch.equal(getattr(restored, name), getattr(rms, name))
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(restored(x), rms(x))

    # The restored copy keeps merging exactly as the original would.
    more = torch.randn(9, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    rms.update(more)
    restored.update(more)
    assert torch.equal(restored.mean, rms.mean) and torch.equal(restored.var, rms.var)

    # And through a serialized file, as in a checkpoint.
    buffer = io.BytesIO()
    torch.save(rms.state_dict(), buffer)
    buffer.seek(0)
    from_file = RunningMeanStd(4)
    from_file.load_state_dict(torch.load(buffer))
    assert torch.equal(from_file.var, rms.var) and from_file.count.item() == rms.count.item()


def test_mean_std_state_round_trips_and_reads_a_torch_modules_state() -> None:
    """The collector's reward scale is a ``MeanStd``; checkpoints written when it was a
    torch module hold tensors, and they load into it unchanged."""
    module = RunningMeanStd(())
    module.update(np.array([1.0, 5.0, -2.0]))
    scale = MeanStd(())
    scale.load_state_dict(module.state_dict())  # torch tensors
    assert float(scale.count) == 3 and float(scale.var) == pytest.approx(float(module.var))
    restored = MeanStd(())
    restored.load_state_dict(scale.state_dict())  # numpy arrays, copies
    scale.update(np.array([7.0]))
    assert float(restored.count) == 3 and float(scale.count) == 4


def test_the_modules_numpy_view_shares_its_buffers() -> None:
    """Updates through ``numpy`` land in the buffers (and so in ``state_dict``), also after
    ``load_state_dict`` and after the buffers were replaced."""
    rms = RunningMeanStd(2)
    rms.numpy.update(np.array([[1.0, 2.0], [3.0, 4.0]]))
    assert rms.count.item() == 2 and rms.mean.tolist() == [2.0, 3.0]
    other = RunningMeanStd(2)
    other.load_state_dict(rms.state_dict())
    other.numpy.update(np.array([[5.0, 6.0]]))
    assert other.state_dict()["count"].item() == 3
    other.mean = torch.zeros(2, dtype=torch.float64)  # a new tensor: the view follows
    other.numpy.update(np.array([[3.0, 3.0]]))
    assert other.mean.tolist() != [0.0, 0.0]


def test_numpy_normalize_matches_forward() -> None:
    """The collector's numpy path gives what the module gives (and clips the same)."""
    rms = RunningMeanStd(6, clip=10.0)
    rms.update(np.random.default_rng(4).normal(3.0, 2.0, size=(50, 6)))
    x = np.random.default_rng(5).normal(size=(12, 6)).astype(np.float32) * 40
    expected = rms(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(rms.numpy.normalize_array(x.copy()), expected, rtol=1e-6, atol=1e-6)
    assert np.abs(expected).max() == rms.clip


@pytest.mark.parametrize("rows", [1, 3])
def test_update_normalize_is_update_then_normalize(rows: int) -> None:
    """The collector's combined step (with its one-row shortcut) against the two calls."""
    data = np.random.default_rng(6).normal(2.0, 3.0, size=(40, rows, 5)).astype(np.float32)
    combined, separate = MeanStd(5, clip=4.0), MeanStd(5, clip=4.0)
    for x in data:
        out = np.empty((rows, 5), dtype=np.float32)
        got = combined.update_normalize(x, out)
        assert got is out
        separate.update(x)
        np.testing.assert_allclose(got, separate.normalize_array(x), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(combined.mean, separate.mean, rtol=1e-12)
    np.testing.assert_allclose(combined.var, separate.var, rtol=1e-12)
    assert combined.count.item() == separate.count.item() == 40 * rows


def test_update_normalize_takes_in_only_the_given_rows() -> None:
    x = np.array([[1.0, 2.0], [100.0, -100.0], [3.0, 6.0]], dtype=np.float32)
    rms = MeanStd(2)
    rms.update_normalize(x, rows=np.array([True, False, True]))
    np.testing.assert_allclose(rms.mean, [2.0, 4.0])
    assert rms.count.item() == 2


def test_update_and_scale_matches_step_by_step_calls() -> None:
    fold = [1.5, None, -2.0, 4.0, None, 0.5]
    values = [1.0, 2.0, -3.0, 0.5, 8.0, -1.0]
    batched, stepwise = MeanStd((), clip=3.0), MeanStd((), clip=3.0)
    got = batched.update_and_scale(fold, values)
    expected = []
    for x, v in zip(fold, values, strict=True):
        if x is not None:
            stepwise.update(np.array([x]))
        expected.append(float(stepwise.scale_array(np.array([v]))[0]))
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    assert batched.count.item() == 4 and batched.var.item() == pytest.approx(stepwise.var.item())


# The runner contract: runners send observation-statistics deltas, the learner merges.


def _chunks(sizes: list[int], dim: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        rng.normal(loc=10.0 * k - 4.0, scale=0.1 + 3 * k, size=(n, dim))
        for k, n in enumerate(sizes)
    ]


@pytest.mark.parametrize(
    "sizes", [[40], [1, 63], [5, 1, 300, 2, 17, 1, 9]], ids=["k=1", "k=2", "k=7"]
)
def test_merged_deltas_equal_the_statistics_of_the_concatenation(sizes: list[int]) -> None:
    """Exact parallel Welford merge (Chan et al. 1979): to float64 rounding, chunks of
    different sizes, a single row among them, merged in any grouping."""
    from trustrl.normalize import RunningStats

    chunks = _chunks(sizes, 4, seed=len(sizes))
    data = np.concatenate(chunks)
    deltas = [RunningStats.of(c) for c in chunks]
    merged = deltas[0]
    for delta in deltas[1:]:
        merged = merged.merge(delta)
    assert merged.count == len(data)
    np.testing.assert_allclose(merged.mean, data.mean(0), rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(merged.var, data.var(0), rtol=1e-12, atol=1e-12)
    # A tree of merges gives the same (the order the learner receives batches in).
    tree = RunningStats.empty(4)
    for delta in reversed(deltas):
        tree = delta.merge(tree)
    np.testing.assert_allclose(tree.mean, merged.mean, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(tree.m2, merged.m2, rtol=1e-12, atol=1e-12)

    # Into the learner's normalizer, which started with data of its own.
    start = _chunks([33], 4, seed=99)[0]
    rms = RunningMeanStd(4)
    rms.update(start)
    for delta in deltas:
        rms.merge(delta)
    everything = np.concatenate([start, data])
    assert rms.count.item() == len(everything)
    np.testing.assert_allclose(rms.mean.numpy(), everything.mean(0), rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(rms.var.numpy(), everything.var(0), rtol=1e-12, atol=1e-12)


def test_merging_an_empty_delta_changes_nothing_and_empty_stats_keep_unit_variance() -> None:
    from trustrl.normalize import RunningStats

    rms = RunningMeanStd(3)
    rms.merge(RunningStats.empty(3))
    assert rms.count.item() == 0
    np.testing.assert_array_equal(rms.var.numpy(), np.ones(3))  # acts as the identity
    rms.update(np.arange(6.0).reshape(2, 3))
    mean, var = rms.mean.clone(), rms.var.clone()
    rms.merge(RunningStats.of(np.zeros((0, 3))))
    assert torch.equal(rms.mean, mean) and torch.equal(rms.var, var)
    # The statistics a learner sends out are its own: merging them into a fresh one copies.
    fresh = RunningMeanStd(3)
    fresh.merge(rms.stats())
    assert torch.equal(fresh.mean, rms.mean) and torch.equal(fresh.count, rms.count)
    torch.testing.assert_close(fresh.var, rms.var, rtol=1e-15, atol=0)


def test_merge_refuses_non_finite_statistics() -> None:
    from trustrl.normalize import RunningStats

    rms = RunningMeanStd(2)
    bad = RunningStats.of(np.array([[1.0, np.nan], [2.0, 3.0]]))
    with pytest.raises(ValueError, match="non-finite"):
        rms.merge(bad)
    assert rms.count.item() == 0
