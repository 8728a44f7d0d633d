"""node_experiment.py end to end, small: 2 emulated nodes of 2 ranks on
shaped virtual links, flat and with --node-aggregation. Node 1's link
carries about half the bytes a step with aggregation (one push per node,
not one per rank), and every layout finishes. Needs root (ip netns, tc);
skipped (exit 77, which ctest shows as skipped) otherwise."""
import json
import os
import subprocess
import sys
import tempfile

if __name__ == "__main__":
    if os.geteuid() != 0:
        print("SKIPPED: the node experiment needs root for ip netns and tc")
        sys.exit(77)
    out = tempfile.mkdtemp(prefix="morse-node-quick-")
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    build = os.environ.get("MORSE_BUILD_DIR", os.path.join(root, "build"))
    result = subprocess.run(["/usr/bin/python3", os.path.join(root, "deploy", "experiments",
                                                              "node_experiment.py"),
                             "--dim", "2000000", "--steps", "8", "--layouts", "flat,leader",
                             "--build", build, "--out", out], timeout=500)
    assert result.returncode == 0, "node_experiment.py failed"
    rows = {r["layout"]: r for r in json.load(open(os.path.join(out, "results.json")))}
    assert set(rows) == {"flat", "node aggregation=leader"}, rows
    flat, leader = rows["flat"], rows["node aggregation=leader"]
    assert flat["workers"] == 4 and leader["workers"] == 2, rows
    # Flat: each of node 1's 2 ranks pushes a worker's payload; aggregated: one.
    assert leader["link_bytes_per_step"] < 0.65 * flat["link_bytes_per_step"], rows
    assert leader["link_bytes_per_step"] >= 0.95 * leader["one_worker_payload"], rows
    leftover = subprocess.run(["ip", "netns", "list"], stdout=subprocess.PIPE, text=True).stdout
    assert "mx" not in leftover, f"namespaces left behind: {leftover}"
    print(f"PASS: node 1's link {leader['link_bytes_per_step']:,.0f} bytes a step with aggregation, "
          f"{flat['link_bytes_per_step']:,.0f} flat")
