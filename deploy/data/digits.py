#!/usr/bin/python3
"""Writes the UCI handwritten digits (shipped with Debian's python3-sklearn)
as CSV files for the mlp workload: label first, then 64 features scaled to
[0, 1]. A fixed shuffle (seed 0) puts 1437 rows in train.csv and 360 in
test.csv.

Usage: deploy/data/digits.py OUT_DIR
"""
import os
import sys


def main():
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if len(sys.argv) == 2 else 2
    try:
        import numpy as np
        from sklearn.datasets import load_digits
    except ImportError as e:
        print(f"digits.py: {e}; install python3-sklearn (apt-get install python3-sklearn)",
              file=sys.stderr)
        return 1
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    digits = load_digits()
    order = np.random.RandomState(0).permutation(len(digits.target))
    features = digits.data[order] / 16.0
    labels = digits.target[order]
    cut = len(labels) - 360
    for name, rows in (("train.csv", slice(0, cut)), ("test.csv", slice(cut, None))):
        with open(os.path.join(out, name), "w") as f:
            f.write("label," + ",".join(f"f{i}" for i in range(64)) + "\n")
            for x, y in zip(features[rows], labels[rows]):
                f.write(f"{y}," + ",".join(f"{v:.6g}" for v in x) + "\n")
    print(f"digits: {cut} training and {len(labels) - cut} test rows in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
