"""Spectral statistics of one weight matrix: median-Hill tail exponent α and stable rank.

The eigenvalues are those of the correlation matrix WᵀW, i.e. λ = σ², with no normalisation (α only
depends on ratios λ_j / λ_xmin, so scaling W does not change it).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Literal

import torch

from megaloop.alrs.schedule import EIGEN_METHODS

logger = logging.getLogger("megaloop.alrs")

EigenMethod = Literal["gram64", "svd32"]

# A tail whose largest eigenvalue exceeds xmin by less than this relative amount is flat up to
# rounding (e.g. an orthogonal matrix): its α would exceed 1e6 and only measure rounding noise.
FLAT_RTOL = 1e-6
# Below this fraction of λ_max an eigenvalue counts as numerically zero. Measured noise floors of
# both methods on exactly rank-deficient fp32 matrices up to 32128x768 stay <= 1e-13·λ_max, while
# genuine median eigenvalues of heavy-tailed matrices sit many orders of magnitude above 1e-12.
ZERO_RTOL = 1e-12


@dataclass(frozen=True)
class SpectralStats:
    """α is NaN for a degenerate matrix; stable_rank = Σλ/λ_max; normalised by min(m, n)."""

    alpha: float
    stable_rank: float
    norm_stable_rank: float


def eigenvalues(weight: torch.Tensor, method: EigenMethod = "gram64") -> torch.Tensor:
    """Ascending fp64 eigenvalues of WᵀW (min(m, n) of them) of a 2-D weight.

    ``gram64`` forms the Gram matrix of the smaller side in fp64 and calls eigvalsh: on CPU it costs
    about what fp32 svdvals costs and agrees with an fp64 SVD to ~1e-8 in α. An fp32 Gram matrix would
    be twice as fast but squares the condition number, and was measured off by up to 0.07 in α on
    ill-conditioned matrices, so it is not offered. ``svd32`` is the reference's fp32 svdvals.
    """
    if weight.ndim != 2:
        raise ValueError(f"ALRS analyses 2-D weights, got shape {tuple(weight.shape)}")
    if not bool(torch.isfinite(weight).all()):  # LAPACK either fails or returns garbage on NaN/Inf
        return torch.full((min(weight.shape),), math.nan, dtype=torch.float64, device=weight.device)
    if method == "gram64":
        tall = weight if weight.shape[0] >= weight.shape[1] else weight.T
        tall = tall.detach().to(torch.float64)
        return torch.linalg.eigvalsh(tall.T @ tall)
    if method == "svd32":
        sigma = torch.linalg.svdvals(weight.detach().to(torch.float32))
        return torch.square(sigma.to(torch.float64)).flip(0)
    raise ValueError(f"ALRS eig_method must be one of {EIGEN_METHODS}, got {method!r}")


def degeneracy(eigs: torch.Tensor) -> str | None:
    """Why the median-Hill α of these ascending eigenvalues is undefined, or None when it is defined.

    Only eigenvalues from the median up enter the estimator, so a zero below the median (one dead
    unit, or the naturally tiny smallest eigenvalue of a square matrix) does not make α undefined;
    a dead layer, a layer of rank below N/2, and NaN/Inf weights do.
    """
    if eigs.numel() < 2:
        return f"only {eigs.numel()} eigenvalue(s)"
    if not bool(torch.isfinite(eigs).all()):
        return "non-finite eigenvalues (NaN/Inf weights)"
    lam_max = float(eigs[-1])
    if lam_max <= 0.0:
        return "all eigenvalues are zero"
    xmin = float(eigs[eigs.numel() // 2])
    if xmin <= ZERO_RTOL * lam_max:
        return "zero eigenvalues at or above the median (rank below N/2)"
    if lam_max <= xmin * (1.0 + FLAT_RTOL):
        return "flat spectrum above the median"
    return None


def median_hill_alpha(eigs: torch.Tensor) -> float:
    """α = 1 + n / (Σ_{j≥i} ln λ_j − n·ln λ_i), i = N // 2, n = N − i, λ ascending; NaN if degenerate."""
    if degeneracy(eigs) is not None:
        return math.nan
    start = eigs.numel() // 2
    tail = eigs[start:]
    n = tail.numel()
    log_excess = float(torch.log(tail).sum()) - n * math.log(float(tail[0]))
    return 1.0 + n / log_excess


def stable_ranks(eigs: torch.Tensor) -> tuple[float, float]:
    """(Σλ / λ_max, that divided by min(m, n) = len(λ)); NaN when λ_max is zero or not finite."""
    lam_max = float(eigs[-1]) if eigs.numel() else math.nan
    if not math.isfinite(lam_max) or lam_max <= 0.0:
        return math.nan, math.nan
    srank = float(eigs.sum()) / lam_max
    return srank, srank / eigs.numel()


def spectral_stats(weight: torch.Tensor, name: str = "",
                   method: EigenMethod = "gram64") -> tuple[SpectralStats, torch.Tensor]:
    """Statistics and ascending eigenvalues of one full (never TP-sharded) weight matrix.

    A degenerate matrix gets α = NaN and a logged warning naming it.
    """
    eigs = eigenvalues(weight, method)
    reason = degeneracy(eigs)
    if reason is not None:
        logger.warning("ALRS: alpha of %s (shape %s) is NaN: %s", name or "<matrix>",
                       tuple(weight.shape), reason)
    srank, norm_srank = stable_ranks(eigs)
    return SpectralStats(median_hill_alpha(eigs), srank, norm_srank), eigs
