"""pipeline_experiment.py's summary on recorded rows: the mean over seeds,
each accuracy's range, a setting with a failed seed shown as failed, and
the table and plot written."""
import os
import sys
import tempfile
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "deploy", "experiments"))
import pipeline_experiment as pe  # noqa: E402


def row(stages, setting, seed, acc, status="ok"):
    r = {"stages": stages, "setting": setting, "forward": "int8/128", "backward": "fp32", "steps": 10,
         "seed": seed, "status": status}
    if status == "ok":
        r.update({m: 1.0 for m in pe.MEASURES})
        r.update(test_accuracy_compressed=acc, test_accuracy_fp32=acc - 0.1, bytes_forward_per_step=100.0 * (seed + 1))
    return r


def main():
    rows = [row(2, "int8", 0, 0.9), row(2, "int8", 1, 0.8), row(2, "int4", 0, 0.7), row(2, "int4", 1, 0, "failed")]
    merged = pe.mean_over_seeds(rows)
    assert [m["setting"] for m in merged] == ["int8", "int4"], merged
    assert abs(merged[0]["test_accuracy_compressed"] - 0.85) < 1e-12, merged[0]
    assert merged[0]["test_accuracy_compressed_range"] == (0.8, 0.9), merged[0]
    assert merged[0]["bytes_forward_per_step"] == 150.0 and merged[0]["seeds"] == 2, merged[0]
    assert merged[1]["status"] == "failed", merged[1]
    with tempfile.TemporaryDirectory() as out:
        args = types.SimpleNamespace(hidden=8, steps=10, batch=4, rate_mbit=100.0, seeds=2)
        text = pe.report(merged, args, out)
        assert "85.00% [80.0, 90.0]" in text and "| 2 | int4 | failed |" in text, text
        assert os.path.exists(os.path.join(out, "report.md"))
        path = pe.plot(merged, out)
        assert path is None or os.path.getsize(path) > 0
    print("PASS")


if __name__ == "__main__":
    main()
