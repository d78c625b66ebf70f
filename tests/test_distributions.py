"""Action heads against torch.distributions as the reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.distributions import Categorical, Independent, Normal, kl_divergence

from trustrl.acting.kernels import (
    NumpyCategorical,
    NumpyGaussian,
    log_softmax_array,
    row_max,
    row_sum,
)
from trustrl.learner.heads import (
    CategoricalHead,
    DiagGaussianHead,
    MultiCategoricalHead,
)

IN_FEATURES = 4
BATCH = 6


def features(seed: int, batch: int = BATCH) -> torch.Tensor:
    return torch.randn(batch, IN_FEATURES, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def categorical() -> CategoricalHead:
    torch.manual_seed(0)
    return CategoricalHead(IN_FEATURES, 5)


@pytest.fixture
def multi() -> MultiCategoricalHead:
    torch.manual_seed(1)
    return MultiCategoricalHead(IN_FEATURES, (3, 2, 4))


@pytest.fixture
def gaussian() -> DiagGaussianHead:
    torch.manual_seed(2)
    head = DiagGaussianHead(IN_FEATURES, 3, log_std_init=-0.5)
    with torch.no_grad():
        head.log_std.copy_(torch.tensor([-0.5, 0.3, -1.2]))
    return head


# Categorical.


def test_categorical_matches_torch(categorical: CategoricalHead) -> None:
    x_old, x_new = features(10), features(11)
    with torch.no_grad():
        old, new = categorical(x_old), categorical(x_new)
        ref_old = Categorical(logits=categorical.linear(x_old))
        ref_new = Categorical(logits=categorical.linear(x_new))
    # Params are normalized log-probabilities.
    torch.testing.assert_close(old.exp().sum(-1), torch.ones(BATCH))
    torch.testing.assert_close(old, ref_old.logits)
    actions = torch.tensor([0, 1, 2, 3, 4, 2])
    torch.testing.assert_close(categorical.log_prob(old, actions), ref_old.log_prob(actions))
    torch.testing.assert_close(categorical.entropy(old), ref_old.entropy())
    torch.testing.assert_close(categorical.kl(old, new), kl_divergence(ref_old, ref_new))
    assert torch.all(categorical.kl(old, new) > 0)
    torch.testing.assert_close(categorical.kl(old, old), torch.zeros(BATCH))
    assert torch.equal(categorical.mode(old), ref_old.probs.argmax(-1))


def test_categorical_sampling_frequencies(categorical: CategoricalHead) -> None:
    logits = torch.tensor([0.0, 1.0, -1.0, 0.5, 2.0])
    params = torch.log_softmax(logits, -1).expand(40_000, -1)
    samples = categorical.sample(params, torch.Generator().manual_seed(3))
    assert samples.shape == (40_000,) and samples.dtype == torch.int64
    freq = torch.bincount(samples, minlength=5).double() / len(samples)
    probs = params[0].exp().double()
    # 4 standard errors per action.
    tolerance = 4 * torch.sqrt(probs * (1 - probs) / len(samples))
    assert torch.all((freq - probs).abs() < tolerance), (freq, probs)


# Multi-categorical.


def multi_reference(head: MultiCategoricalHead, x: torch.Tensor) -> list[Categorical]:
    logits = head.linear(x)
    return [Categorical(logits=b) for b in torch.split(logits, head.nvec, dim=-1)]


def test_multicategorical_matches_torch(multi: MultiCategoricalHead) -> None:
    x_old, x_new = features(20), features(21)
    with torch.no_grad():
        old, new = multi(x_old), multi(x_new)
        ref_old, ref_new = multi_reference(multi, x_old), multi_reference(multi, x_new)
    actions = torch.tensor([[0, 1, 3], [2, 0, 0], [1, 1, 2], [0, 0, 1], [2, 1, 3], [1, 0, 0]])
    expected_lp = sum(d.log_prob(actions[:, i]) for i, d in enumerate(ref_old))
    torch.testing.assert_close(multi.log_prob(old, actions), expected_lp)
    torch.testing.assert_close(multi.entropy(old), sum(d.entropy() for d in ref_old))
    expected_kl = sum(kl_divergence(o, n) for o, n in zip(ref_old, ref_new, strict=True))
    torch.testing.assert_close(multi.kl(old, new), expected_kl)
    mode = multi.mode(old)
    assert torch.equal(mode, torch.stack([d.probs.argmax(-1) for d in ref_old], -1))
    samples = multi.sample(old, torch.Generator().manual_seed(0))
    assert samples.shape == (BATCH, 3)
    for i, n in enumerate(multi.nvec):
        assert samples[:, i].min() >= 0 and samples[:, i].max() < n


def test_multicategorical_mask_per_component(multi: MultiCategoricalHead) -> None:
    mask = torch.tensor([True, False, True, False, True, True, True, False, False])
    with torch.no_grad():
        params = multi(features(22, batch=1), mask[None]).expand(5_000, -1)
    samples = multi.sample(params, torch.Generator().manual_seed(1))
    assert set(samples[:, 0].tolist()) == {0, 2}
    assert set(samples[:, 1].tolist()) == {1}
    assert set(samples[:, 2].tolist()) == {0, 1}
    assert torch.isfinite(multi.entropy(params)).all()


# Masked categorical.


MASK = torch.tensor(
    [
        [True, False, True, False, True],
        [False, False, False, True, False],  # one allowed action
        [True, True, True, True, True],
        [False, True, True, False, False],
    ]
)


def renormalized(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The allowed actions' probabilities, renormalized, zeros elsewhere."""
    probs = logits.softmax(-1) * mask
    return probs / probs.sum(-1, keepdim=True)


def test_masked_actions_are_never_sampled(categorical: CategoricalHead) -> None:
    x = features(30, batch=4)
    with torch.no_grad():
        params = categorical(x, MASK)
        expected = renormalized(categorical.linear(x), MASK)
    draws = 20_000
    samples = categorical.sample(
        params.repeat_interleave(draws, 0), torch.Generator().manual_seed(5)
    ).reshape(4, draws)
    for row in range(4):
        counts = torch.bincount(samples[row], minlength=5)
        assert torch.all(counts[~MASK[row]] == 0), (row, counts)
        freq = counts.double() / draws
        torch.testing.assert_close(freq, expected[row].double(), rtol=0, atol=0.015)
    assert torch.all(samples[1] == 3)


def test_masked_log_prob_entropy_kl(categorical: CategoricalHead) -> None:
    x_old, x_new = features(31, batch=4), features(32, batch=4)
    with torch.no_grad():
        old, new = categorical(x_old, MASK), categorical(x_new, MASK)
        allowed_old = renormalized(categorical.linear(x_old), MASK)
        allowed_new = renormalized(categorical.linear(x_new), MASK)

    for row in range(4):
        for action in range(5):
            lp = categorical.log_prob(old[row : row + 1], torch.tensor([action]))
            if MASK[row, action]:
                assert lp.item() == pytest.approx(math.log(allowed_old[row, action]), abs=1e-5)
            else:
                assert lp.item() < -1e6

    entropy = categorical.entropy(old)
    assert torch.isfinite(entropy).all()
    torch.testing.assert_close(entropy, Categorical(probs=allowed_old).entropy())
    assert entropy[1].item() == pytest.approx(0.0, abs=1e-6)  # a single allowed action

    kl = categorical.kl(old, new)
    assert torch.isfinite(kl).all()
    reference = kl_divergence(Categorical(probs=allowed_old), Categorical(probs=allowed_new))
    torch.testing.assert_close(kl, reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(categorical.kl(old, old), torch.zeros(4), rtol=0, atol=1e-6)


def test_masked_entropy_gradient_is_finite(categorical: CategoricalHead) -> None:
    params = categorical(features(33, batch=4), MASK)
    loss = (
        categorical.entropy(params).sum()
        + categorical.log_prob(params, torch.tensor([0, 3, 1, 2])).sum()
    )
    loss.backward()
    for p in categorical.parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all()


# Diagonal Gaussian.


def gaussian_reference(head: DiagGaussianHead, x: torch.Tensor) -> Independent:
    return Independent(Normal(head.linear(x), head.log_std.exp().expand(len(x), -1)), 1)


def test_gaussian_matches_torch(gaussian: DiagGaussianHead) -> None:
    x_old, x_new = features(40), features(41)
    with torch.no_grad():
        old = gaussian(x_old)
        ref_old = gaussian_reference(gaussian, x_old)
        gaussian.log_std.add_(torch.tensor([0.4, -0.2, 0.1]))
        new = gaussian(x_new)
        ref_new = gaussian_reference(gaussian, x_new)
    assert old.shape == (BATCH, 6)
    actions = torch.randn(BATCH, 3, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(gaussian.log_prob(old, actions), ref_old.log_prob(actions))
    torch.testing.assert_close(gaussian.entropy(old), ref_old.entropy())
    torch.testing.assert_close(gaussian.kl(old, new), kl_divergence(ref_old, ref_new))
    torch.testing.assert_close(gaussian.kl(old, old), torch.zeros(BATCH), rtol=0, atol=1e-6)
    torch.testing.assert_close(gaussian.mode(old), ref_old.mean)


def test_gaussian_sample_statistics(gaussian: DiagGaussianHead) -> None:
    n = 100_000
    with torch.no_grad():
        params = gaussian(features(42, batch=1)).expand(n, -1)
    mean, std = params[0, :3], params[0, 3:].exp()
    samples = gaussian.sample(params, torch.Generator().manual_seed(6))
    assert samples.shape == (n, 3)
    assert torch.all((samples.mean(0) - mean).abs() < 4 * std / math.sqrt(n))
    torch.testing.assert_close(samples.std(0), std, rtol=0.01, atol=0)
    # Components are independent.
    corr = torch.corrcoef(samples.T)
    torch.testing.assert_close(corr, torch.eye(3), rtol=0, atol=0.02)


@pytest.mark.parametrize("kind", ["categorical", "multi", "gaussian"])
def test_sampling_reproducible_with_same_generator_seed(kind: str, request) -> None:
    head = request.getfixturevalue(kind)
    with torch.no_grad():
        params = head(features(50, batch=64))
    first = head.sample(params, torch.Generator().manual_seed(123))
    second = head.sample(params, torch.Generator().manual_seed(123))
    other = head.sample(params, torch.Generator().manual_seed(124))
    assert torch.equal(first, second)
    assert not torch.equal(first, other)


@pytest.mark.parametrize("columns", [1, 2, 5, 16, 17, 40])
def test_numpy_row_reductions_and_log_softmax(columns: int) -> None:
    """The numpy paths' row max, row sum and log-softmax against numpy's own (both of
    row_max's ways: columns up to 16 and more)."""
    x = np.random.default_rng(columns).normal(0.0, 30.0, size=(33, columns)).astype(np.float32)
    np.testing.assert_array_equal(row_max(x), x.max(-1, keepdims=True))
    np.testing.assert_allclose(row_sum(x), x.sum(-1, keepdims=True), rtol=1e-5, atol=1e-3)
    block = x[:, : max(1, columns // 2)]  # a strided view, as the multi-categorical blocks
    np.testing.assert_array_equal(row_max(block), block.max(-1, keepdims=True))
    expected = torch.log_softmax(torch.from_numpy(x), -1).numpy()
    np.testing.assert_allclose(log_softmax_array(x), expected, rtol=1e-5, atol=1e-5)


# The numpy twins (NumpyCategorical, NumpyGaussian) against their torch heads.

TWIN_ROWS = 7


def twin_case(kind: str, masked: bool = False):
    """A torch head, its numpy twin, raw head outputs (rows, width), a mask, actions."""
    torch.manual_seed(5)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(TWIN_ROWS, IN_FEATURES, generator=g, dtype=torch.float32)
    if kind == "gaussian":
        head: torch.nn.Module = DiagGaussianHead(IN_FEATURES, 3)
        with torch.no_grad():
            head.log_std.copy_(torch.tensor([-0.5, 0.3, -1.2]))
        twin: NumpyCategorical | NumpyGaussian = NumpyGaussian(head.log_std.detach().numpy())
        actions = torch.randn(TWIN_ROWS, 3, generator=g)
        return head, twin, x, None, actions
    nvec = (5,) if kind == "categorical" else (3, 2, 4)
    head = (
        CategoricalHead(IN_FEATURES, 5)
        if kind == "categorical"
        else MultiCategoricalHead(IN_FEATURES, nvec)
    )
    twin = NumpyCategorical(nvec)
    mask = None
    if masked:
        mask = torch.rand(TWIN_ROWS, sum(nvec), generator=g) > 0.4
        for lo, _ in twin.blocks:
            mask[:, lo] = True
    blocks = []
    for i, n in enumerate(nvec):
        lo = twin.blocks[i][0]
        allowed = mask[:, lo : lo + n] if mask is not None else torch.ones(TWIN_ROWS, n, dtype=bool)
        # An allowed action per row, drawn among them.
        choice = torch.multinomial(allowed.float(), 1, generator=g)[:, 0]
        blocks.append(choice)
    actions = blocks[0] if kind == "categorical" else torch.stack(blocks, -1)
    return head, twin, x, mask, actions


TWINS = [
    ("categorical", False),
    ("categorical", True),
    ("multi", False),
    ("multi", True),
    ("gaussian", False),
]


@pytest.mark.parametrize(("kind", "masked"), TWINS)
def test_numpy_twins_match_their_heads(kind: str, masked: bool) -> None:
    head, twin, x, mask, actions = twin_case(kind, masked)
    with torch.no_grad():
        params = head(x, mask)
        out = head.linear(x).numpy()
    np_mask = mask.numpy() if mask is not None else None
    np_params = twin.params(out, np_mask)
    np_actions = actions.numpy()
    np.testing.assert_allclose(
        twin.log_prob(np_params, np_actions), head.log_prob(params, actions), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(twin.entropy(np_params), head.entropy(params), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(twin.act(out, np_mask, None), head.mode(params).numpy())


@pytest.mark.parametrize(("kind", "masked"), TWINS)
@pytest.mark.parametrize("ent_coef", [0.0, 0.1])
def test_numpy_twin_backward_is_autograds(kind: str, masked: bool, ent_coef: float) -> None:
    """``terms`` (the gradient path's forward pass) equal to the head's log-prob and mean
    entropy, and ``backward``: d/d outputs (and log_std) of sum(w * logprob) - ent_coef *
    mean(entropy), the shape of every loss the numpy gradients build on a head, against
    autograd."""
    head, twin, x, mask, actions = twin_case(kind, masked)
    weights = torch.linspace(-1.0, 2.0, TWIN_ROWS)
    out = head.linear(x).detach().requires_grad_(True)
    head.linear = torch.nn.Identity()  # the head's own forward, from its raw outputs
    params = head(out, mask)
    loss = (weights * head.log_prob(params, actions)).sum() - ent_coef * head.entropy(params).mean()
    loss.backward()
    np_mask = mask.numpy() if mask is not None else None
    logprob, entropy, residuals = twin.terms(out.detach().numpy(), actions.numpy(), np_mask)
    with torch.no_grad():
        want_logprob, want_entropy = head.log_prob(params, actions), head.entropy(params).mean()
    np.testing.assert_allclose(logprob, want_logprob, rtol=1e-5, atol=1e-5)
    assert entropy == pytest.approx(float(want_entropy), rel=1e-5, abs=1e-6)
    d_out, d_log_std = twin.backward(residuals, weights.numpy(), -ent_coef)
    assert out.grad is not None
    np.testing.assert_allclose(d_out, out.grad.numpy(), rtol=1e-5, atol=1e-6)
    if kind == "gaussian":
        assert d_log_std is not None and head.log_std.grad is not None
        np.testing.assert_allclose(d_log_std, head.log_std.grad.numpy(), rtol=1e-5, atol=1e-6)
    else:
        assert d_log_std is None


@pytest.mark.parametrize("per_agent", [False, True])
def test_gaussian_log_prob_of_its_noise_is_its_log_prob(per_agent: bool) -> None:
    """The acting path's log-density from the draw equals the one from the action."""
    log_std = np.array(
        [[-0.5, 0.3, -1.2], [0.2, -0.1, 0.0]] if per_agent else [-0.5, 0.3, -1.2], dtype=np.float32
    )
    twin = NumpyGaussian(log_std)
    agent = np.arange(40) % 2
    means = np.random.default_rng(0).normal(size=(40, 3)).astype(np.float32)
    noise = twin.noise(np.random.default_rng(1), 1, agent)[0]
    actions = twin.act(means, None, noise)
    np.testing.assert_allclose(
        twin.log_prob_of_noise(noise, agent),
        twin.log_prob(means, actions, agent),
        rtol=1e-5,
        atol=1e-5,
    )
    # The draws are std z: their spread per dimension is each row's agent's std.
    many = twin.noise(np.random.default_rng(2), 4000, agent[:2])
    std = np.exp(log_std if per_agent else np.stack([log_std, log_std]))
    np.testing.assert_allclose(many.std(0), std, rtol=0.05)


def test_categorical_twin_samples_with_the_heads_frequencies() -> None:
    """argmax(logits + Gumbel) draws each allowed action with its renormalized probability."""
    twin = NumpyCategorical((5,))
    logits = np.array([[0.0, 1.0, -1.0, 0.5, 2.0]], dtype=np.float32)
    mask = np.array([[True, True, False, True, True]])
    draws = 40_000
    noise = twin.noise(np.random.default_rng(3), draws, np.zeros(1, dtype=np.int64))[:, 0]
    samples = twin.act(np.repeat(logits, draws, 0), np.repeat(mask, draws, 0), noise)
    expected = renormalized(torch.from_numpy(logits), torch.from_numpy(mask))[0].double()
    freq = torch.from_numpy(np.bincount(samples, minlength=5)).double() / draws
    tolerance = 4 * torch.sqrt(expected * (1 - expected) / draws) + 1e-12
    assert freq[2] == 0.0
    assert torch.all((freq - expected).abs() <= tolerance), (freq, expected)
