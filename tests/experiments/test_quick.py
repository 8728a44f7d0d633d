"""The experiments' quick mode end to end: a 2-host virtual cluster, the
netprobe ceiling, fp32 and 1-bit Morse and fp32 DDP, the report. Needs root
(ip netns, tc); skipped (exit 77, which ctest shows as skipped) otherwise."""
import csv
import os
import subprocess
import sys
import tempfile

if __name__ == "__main__":
    if os.geteuid() != 0:
        print("SKIPPED: the quick experiment needs root for ip netns and tc")
        sys.exit(77)
    out = tempfile.mkdtemp(prefix="morse-quick-")
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    result = subprocess.run(["/usr/bin/python3", os.path.join(root, "deploy", "experiments", "experiment.py"),
                             "--quick", "--out", out], timeout=300)
    assert result.returncode == 0, "experiment.py --quick failed"
    rows = list(csv.DictReader(open(os.path.join(out, "results.csv"))))
    assert {r["scheme"] for r in rows} == {"fp32", "onebit", "ddp_fp32"}, rows
    for r in rows:
        assert r["status"] == "ok", r
        assert float(r["ceiling_up_gbps"]) > 0.5, r  # 1 Gbit/s links
    one = {r["scheme"]: r for r in rows}
    assert float(one["onebit"]["payload_bytes_per_step"]) * 25 < float(one["fp32"]["payload_bytes_per_step"])
    assert os.path.exists(os.path.join(out, "report.md"))
    leftover = subprocess.run(["ip", "netns", "list"], stdout=subprocess.PIPE, text=True).stdout
    assert "mx" not in leftover, f"namespaces left behind: {leftover}"
    print("PASS")
