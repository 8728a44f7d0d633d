"""The one rule by which a test decides that a Morse optimizer trains as well
as its reference (issue 34): never on one seed's number, which another CPU
(another instruction set in torch's or OpenBLAS's kernels) moves as much as
another seed does, but on the seeds' paired gaps and the noise measured in
the same run.

Each seed trains Morse and the reference from the same weights on the same
batches; gap = (morse - reference) / reference for a loss (or reference -
morse for an accuracy, in points). The check fails only when the mean gap
is above `margin` by more than the seeds explain: mean - t * se > margin,
with se the standard error of the paired gaps and t Student's one-sided
99.5% quantile for their count. A real regression (a gap well above the
margin, or a divergence) fails it; a host that moves every run as a new
seed would fails it with probability under 0.5% per check when the true gap
is at the margin, and far less below it.

The precise claims (2% over 5-20 seeds) live in docs/convergence.md.
"""
import math
import sys

# Student's t, one-sided 99.5%, by degrees of freedom (scipy.stats.t.ppf).
_T995 = (63.657, 9.925, 5.841, 4.604, 4.032, 3.707, 3.499, 3.355, 3.250, 3.169, 3.106, 3.055,
         3.012, 2.977, 2.947, 2.921, 2.898, 2.878, 2.861, 2.845, 2.831, 2.819, 2.807, 2.797,
         2.787, 2.779, 2.771, 2.763, 2.756, 2.750)
MIN_SEEDS = 3


def t995(df):
    return _T995[df - 1] if df <= len(_T995) else 2.576 + 2.0 / df


class Verdict:
    """mean, se (None below 2 gaps), limit (the largest mean that passes)
    and ok for `gaps` against `margin`."""

    def __init__(self, gaps, margin):
        if len(gaps) < MIN_SEEDS:
            raise ValueError(f"a convergence check needs {MIN_SEEDS} or more seeds, got {len(gaps)}: "
                             "one seed's number measures the seed and the host, not Morse")
        n = len(gaps)
        self.n = n
        self.mean = sum(gaps) / n
        self.se = math.sqrt(sum((g - self.mean) ** 2 for g in gaps) / (n - 1) / n)
        self.margin = margin
        self.limit = margin + t995(n - 1) * self.se
        self.ok = self.mean <= self.limit

    def describe(self, scale=100, unit="%"):
        return (f"paired gap {scale * self.mean:+.2f}{unit} +- {scale * self.se:.2f}{unit} (se, "
                f"{self.n} seeds); limit {scale * self.margin:+.1f}{unit} + "
                f"{t995(self.n - 1):.2f} se = {scale * self.limit:+.2f}{unit}: "
                f"{'ok' if self.ok else 'FAIL'}")


def main(argv):
    """seeds.py MARGIN GAP GAP GAP... : prints the verdict, exits 1 on FAIL
    (the C++ tests' way to the same rule)."""
    if len(argv) < 2:
        print("usage: seeds.py MARGIN GAP GAP GAP... (fractions; gap > 0 means Morse is behind)",
              file=sys.stderr)
        return 2
    try:
        margin, gaps = float(argv[0]), [float(g) for g in argv[1:]]
        verdict = Verdict(gaps, margin)
    except ValueError as e:
        print(f"seeds.py: {e}", file=sys.stderr)
        return 2
    print(verdict.describe())
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
