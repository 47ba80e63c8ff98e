"""Goodness-of-fit statistics used to check that speculative sampling matches the target
distribution (tests and `tokenmill verify-spec`). Pure torch, no scipy."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ChiSquareResult:
    statistic: float
    dof: int
    p_value: float
    total_variation: float

    def passed(self, alpha: float) -> bool:
        return self.p_value >= alpha


def chi_square_gof(counts, expected_probs, min_expected: float = 5.0) -> ChiSquareResult:
    """Pearson chi-square of observed ``counts`` [V] against ``expected_probs`` [V]. Cells with
    expected count below ``min_expected`` are pooled into one (the test's usual validity rule)."""
    counts = torch.as_tensor(counts, dtype=torch.float64).detach()
    probs = torch.as_tensor(expected_probs, dtype=torch.float64).detach()
    probs = probs / probs.sum()
    n = counts.sum()
    expected = probs * n
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = max(int(keep.sum()) - 1, 1)
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(stat / 2, dtype=torch.float64)))
    tv = 0.5 * float((counts / n - probs).abs().sum())
    return ChiSquareResult(stat, dof, p_value, tv)


def two_sample_chi_square(counts_a, counts_b, min_count: float = 5.0) -> ChiSquareResult:
    """Homogeneity test of two count vectors over the same cells (spec vs plain sampling when
    the exact target distribution is not at hand). Sparse cells are pooled."""
    a = torch.as_tensor(counts_a, dtype=torch.float64)
    b = torch.as_tensor(counts_b, dtype=torch.float64)
    big = (a + b) >= 2 * min_count
    a = torch.cat([a[big], a[~big].sum().reshape(1)])
    b = torch.cat([b[big], b[~big].sum().reshape(1)])
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    na, nb = a.sum(), b.sum()
    total = a + b
    ea, eb = total * na / (na + nb), total * nb / (na + nb)
    stat = float(((a - ea) ** 2 / ea).sum() + ((b - eb) ** 2 / eb).sum())
    dof = max(int(keep.sum()) - 1, 1)
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(stat / 2, dtype=torch.float64)))
    tv = 0.5 * float((a / na - b / nb).abs().sum())
    return ChiSquareResult(stat, dof, p_value, tv)
