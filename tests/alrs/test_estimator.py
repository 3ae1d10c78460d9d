import logging
import math

import numpy as np
import pytest
import torch

from megaloop.alrs.estimator import eigenvalues, median_hill_alpha, spectral_stats, stable_ranks


def _numpy_reference_alpha(eigs: np.ndarray) -> float:
    """The reference formula written independently: xmin = median eigenvalue, natural logs."""
    lam = np.sort(np.asarray(eigs, dtype=np.float64))
    i = int(len(lam) / 2)
    n = len(lam) - i
    return 1.0 + n / (np.sum(np.log(lam[i:])) - n * np.log(lam[i]))


def _matrix_with_eigenvalues(lam: np.ndarray, m: int, seed: int = 0) -> torch.Tensor:
    """An m x len(lam) matrix whose WᵀW has exactly the eigenvalues lam (random singular vectors)."""
    g = torch.Generator().manual_seed(seed)
    n = len(lam)
    u, _ = torch.linalg.qr(torch.randn(m, n, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return (u * torch.from_numpy(np.sqrt(lam))) @ v.T


@pytest.mark.parametrize("alpha", [1.5, 2.0, 3.0, 4.5])
def test_recovers_pareto_tail_exponent(alpha):
    # Eigenvalues drawn from a Pareto density p(λ) ∝ λ^-α. Above the median they are again Pareto,
    # so with n = N/2 the estimator's n−1 nonzero log-ratios are iid Exp(α−1): α̂−1 = n/Gamma(n−1),
    # mean (α−1)·n/(n−2) and std ≈ (α−1)/√n. Tolerance: the bias plus 5 standard deviations.
    n_eigs = 2048
    rng = np.random.default_rng(int(alpha * 10))
    lam = rng.uniform(size=n_eigs) ** (-1.0 / (alpha - 1.0))
    n = n_eigs // 2
    tolerance = (alpha - 1) * (2 / (n - 2) + 5 / math.sqrt(n))
    estimate = median_hill_alpha(torch.from_numpy(np.sort(lam)))
    assert abs(estimate - alpha) < tolerance, (estimate, alpha, tolerance)


@pytest.mark.parametrize("n_eigs", [7, 64, 301, 768])
def test_alpha_equals_independent_numpy_formula(n_eigs):
    rng = np.random.default_rng(n_eigs)
    lam = np.sort(rng.lognormal(sigma=2.0, size=n_eigs))
    assert median_hill_alpha(torch.from_numpy(lam)) == pytest.approx(_numpy_reference_alpha(lam),
                                                                    rel=1e-12)


@pytest.mark.parametrize("method", ["gram64", "svd32"])
@pytest.mark.parametrize("shape", [(96, 64), (64, 160)])
def test_eigenvalues_of_a_matrix_and_its_stats(method, shape):
    m, n = shape
    k = min(m, n)
    lam = np.sort(np.random.default_rng(1).pareto(2.0, size=k) + 0.1)
    w = _matrix_with_eigenvalues(lam, max(m, n))
    w = (w if m >= n else w.T).to(torch.float32)
    stats, eigs = spectral_stats(w, "w", method)
    assert eigs.shape == (k,) and bool((eigs[1:] >= eigs[:-1]).all())
    lam32 = np.sort(np.linalg.svd(w.double().numpy(), compute_uv=False) ** 2)
    assert np.allclose(eigs.numpy(), lam32, rtol=1e-4, atol=1e-6 * lam32.max())
    assert stats.alpha == pytest.approx(_numpy_reference_alpha(lam32), abs=1e-4)
    assert stats.stable_rank == pytest.approx(lam32.sum() / lam32.max(), rel=1e-5)
    assert stats.norm_stable_rank == pytest.approx(lam32.sum() / lam32.max() / k, rel=1e-5)


def test_gram64_agrees_with_svd32_on_preset_shapes():
    torch.manual_seed(0)
    for shape in [(2304, 768), (768, 1512)]:
        for w in (torch.randn(shape), torch.distributions.StudentT(2.5).sample(shape)):
            a_gram = median_hill_alpha(eigenvalues(w, "gram64"))
            a_svd = median_hill_alpha(eigenvalues(w, "svd32"))
            assert abs(a_gram - a_svd) < 1e-4, (shape, a_gram, a_svd)


def test_alpha_is_scale_invariant():
    w = torch.distributions.StudentT(3.0).sample((200, 100))
    # Scaling by 64 is exact in floating point, so only the estimator's own ratios can differ.
    assert median_hill_alpha(eigenvalues(64 * w)) == pytest.approx(median_hill_alpha(eigenvalues(w)),
                                                                   rel=1e-12)


@pytest.mark.parametrize("case", ["zeros", "nan", "inf", "rank_below_half", "flat"])
def test_degenerate_matrices_get_nan_alpha_and_a_warning(case, caplog):
    w = torch.randn(64, 48)
    if case == "zeros":
        w.zero_()
    elif case == "nan":
        w[3, 5] = math.nan
    elif case == "inf":
        w[0, 0] = math.inf
    elif case == "rank_below_half":
        w = torch.randn(64, 10) @ torch.randn(10, 48)
    else:
        w = torch.linalg.qr(torch.randn(64, 48, dtype=torch.float64))[0]  # all σ = 1
    with caplog.at_level(logging.WARNING, logger="megaloop.alrs"):
        stats, _ = spectral_stats(w, "decoder.layers.0.mlp.linear_fc1.weight")
    assert math.isnan(stats.alpha)
    assert "decoder.layers.0.mlp.linear_fc1.weight" in caplog.text and "NaN" in caplog.text


def test_a_zero_below_the_median_does_not_make_alpha_nan(caplog):
    # One dead input unit gives one zero eigenvalue; the estimator never reads it (documented choice).
    w = torch.distributions.StudentT(3.0).sample((64, 48))
    w[:, 7] = 0
    with caplog.at_level(logging.WARNING, logger="megaloop.alrs"):
        stats, eigs = spectral_stats(w)
    assert float(eigs[0]) < 1e-10 * float(eigs[-1])
    assert math.isfinite(stats.alpha) and not caplog.text


def test_stable_ranks_of_known_spectrum():
    srank, norm = stable_ranks(torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64))
    assert srank == 2.5 and norm == 2.5 / 4
    assert all(math.isnan(x) for x in stable_ranks(torch.zeros(3, dtype=torch.float64)))


def test_rejects_non_matrices_and_unknown_methods():
    with pytest.raises(ValueError, match="2-D"):
        eigenvalues(torch.ones(3))
    with pytest.raises(ValueError, match="eig_method"):
        eigenvalues(torch.ones(3, 3), "svd16")


def test_powerlaw_with_fixed_median_xmin_is_the_same_estimator():
    powerlaw = pytest.importorskip("powerlaw")
    rng = np.random.default_rng(3)
    for lam in (np.sort(rng.pareto(1.5, 500) + 1.0), np.sort(rng.lognormal(size=301))):
        fit = powerlaw.Fit(lam, xmin=float(lam[len(lam) // 2]), verbose=False,
                           parameter_ranges={"alpha": [1.0, 1e6]})  # the default range clips at 3
        assert median_hill_alpha(torch.from_numpy(lam)) == pytest.approx(fit.power_law.alpha, abs=1e-6)
