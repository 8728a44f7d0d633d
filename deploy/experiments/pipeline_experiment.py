#!/usr/bin/python3
"""Pipeline-parallel training with compressed stage boundaries on virtual
Ethernet links (morse.torch.pipeline; issue 17).

    sudo deploy/experiments/pipeline_experiment.py --out out/experiments/pipeline
    sudo deploy/experiments/pipeline_experiment.py --quick --out /tmp/pp   # ~2 minutes

Trains the digits MLP of worker/python/examples/digits_pipeline.py (hidden
width --hidden, one Linear+ReLU block per stage, nothing tuned for this)
split into 2 and 4 stages, one process per stage, each in its own network
namespace on a bridge shaped to --rate-mbit both ways (tbf), addressed from
198.18.0.0/15 (VirtualCluster of experiment.py; everything is removed on
exit). Each boundary setting (activations / gradients) runs --steps steps
of GPipe with a plain torch.optim.Adam per stage, then reports the held-out
loss and accuracy with the boundaries compressed and in fp32, the bytes per
step of one boundary each way, and the time per step. Writes
OUT/results.csv, OUT/pipeline.png and OUT/report.md. Needs root.
"""
import argparse
import csv
import json
import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
from experiment import VirtualCluster, stop, wait_all  # noqa: E402

# (name, activations, gradients): the settings of Rudakov et al. 2024.
SETTINGS = [
    ("none", "fp32", "fp32"),
    ("int8", "int8/128", "int8/128"),
    ("int4 act, int8 grad", "int4/128", "int8/128"),
    ("int4", "int4/128", "int4/128"),
    ("topk 30%", "topk:0.3", "topk:0.3"),
    ("topk 10%", "topk:0.1", "topk:0.1"),
    ("topk 30% + EF", "topk:0.3+ef", "topk:0.3+ef"),
    ("topk 10% + EF", "topk:0.1+ef", "topk:0.1+ef"),
    ("topk 30% + AQ-SGD", "topk:0.3+aq", "topk:0.3"),
    ("topk 10% + AQ-SGD", "topk:0.1+aq", "topk:0.1"),
]
QUICK = ["none", "int8", "topk 10%", "topk 10% + EF", "topk 10% + AQ-SGD"]
FIELDS = ["stages", "setting", "forward", "backward", "steps", "seed", "test_loss_compressed", "test_accuracy_compressed",
          "test_loss_fp32", "test_accuracy_fp32", "bytes_forward_per_step", "bytes_backward_per_step",
          "seconds_per_step", "final_train_loss", "status"]


def run_one(vc, stages, forward, backward, args, work, seed):
    example = os.path.join(ROOT, "worker", "python", "examples", "digits_pipeline.py")
    port = 29500
    procs, logs = [], []
    for s in range(stages):
        env = [f"MORSE_STAGE={s}", f"MORSE_STAGES={stages}", "MORSE_INSECURE=1",
               f"PYTHONPATH={args.python_path}"]
        if s > 0:
            env.append(f"MORSE_STAGE_LISTEN={vc.address(s)}:{port}")
        if s < stages - 1:
            env.append(f"MORSE_STAGE_NEXT={vc.address(s + 1)}:{port}")
        log = open(os.path.join(work, f"stage-{s}.log"), "w+")
        logs.append(log)
        argv = ["env", *env, "/usr/bin/python3", example, "--optimizer", "local", "--steps", str(args.steps),
                "--hidden", str(args.hidden), "--batch", str(args.batch), "--microbatches", "4",
                "--forward", forward, "--backward", backward, "--timeout", "60", "--seed", str(seed)]
        procs.append(vc.popen(s, argv, log))
    codes = wait_all(procs, args.timeout)
    stop(procs)
    results = {}
    for s, log in enumerate(logs):
        log.seek(0)
        for line in log:
            if line.startswith("{"):
                results[s] = json.loads(line)
        log.close()
    if any(c != 0 for c in codes) or len(results) != stages:
        tail = open(os.path.join(work, f"stage-{stages - 1}.log")).read()[-800:]
        return {"status": f"failed {codes}: {tail}"}
    last = results[stages - 1]
    return {"test_loss_compressed": last["test_loss_compressed"],
            "test_accuracy_compressed": last["test_accuracy_compressed"],
            "test_loss_fp32": last["test_loss_fp32"], "test_accuracy_fp32": last["test_accuracy_fp32"],
            "bytes_forward_per_step": results[0]["bytes_forward_per_step"],
            "bytes_backward_per_step": results[1]["bytes_backward_per_step"],
            "seconds_per_step": max(r["seconds_per_step"] for r in results.values()),
            "final_train_loss": last["final_loss"], "status": "ok"}


MEASURES = ["test_loss_compressed", "test_accuracy_compressed", "test_loss_fp32", "test_accuracy_fp32",
            "bytes_forward_per_step", "bytes_backward_per_step", "seconds_per_step", "final_train_loss"]


def mean_over_seeds(rows):
    """One row per (stages, setting): the mean of its seeds' measures, with
    each accuracy's min and max, or status 'failed' if any seed failed."""
    out = []
    for key in dict.fromkeys((r["stages"], r["setting"]) for r in rows):
        group = [r for r in rows if (r["stages"], r["setting"]) == key]
        merged = {k: group[0][k] for k in ("stages", "setting", "forward", "backward", "steps")}
        merged["seeds"] = len(group)
        if any(r["status"] != "ok" for r in group):
            merged["status"] = "failed"
            out.append(merged)
            continue
        merged["status"] = "ok"
        for m in MEASURES:
            merged[m] = sum(r[m] for r in group) / len(group)
        for m in ("test_accuracy_compressed", "test_accuracy_fp32"):
            merged[m + "_range"] = (min(r[m] for r in group), max(r[m] for r in group))
        out.append(merged)
    return out


def plot(rows, out):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ok = [r for r in rows if r["status"] == "ok"]
    names = [n for n, _, _ in SETTINGS if any(r["setting"] == n for r in ok)]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    width = 0.2
    for k, stages in enumerate(sorted({r["stages"] for r in ok})):
        by = {r["setting"]: r for r in ok if r["stages"] == stages}
        xs = [i + (k - 0.5) * 2 * width for i in range(len(names))]
        axes[0].bar([x - width / 2 for x in xs], [by[n]["test_accuracy_compressed"] * 100 if n in by else 0
                                                  for n in names], width, label=f"{stages} stages, compressed")
        axes[0].bar([x + width / 2 for x in xs], [by[n]["test_accuracy_fp32"] * 100 if n in by else 0
                                                  for n in names], width, label=f"{stages} stages, fp32", alpha=0.6)
        axes[1].bar(xs, [by[n]["bytes_forward_per_step"] + by[n]["bytes_backward_per_step"] if n in by else 0
                         for n in names], 2 * width, label=f"{stages} stages")
        axes[2].bar(xs, [by[n]["seconds_per_step"] * 1000 if n in by else 0 for n in names], 2 * width,
                    label=f"{stages} stages")
    for ax, title in zip(axes, ["held-out accuracy (%) with inference compressed / fp32",
                                "bytes per step, one boundary, both ways", "time per step (ms)"]):
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=60, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    axes[0].set_ylim(0, 100)
    fig.tight_layout()
    path = os.path.join(out, "pipeline.png")
    fig.savefig(path, dpi=110)
    return path


def report(rows, args, out):
    lines = [f"# Pipeline boundaries: digits MLP (hidden {args.hidden}), {args.steps} steps, batch {args.batch}, "
             f"4 micro-batches, GPipe, {args.rate_mbit:g} Mbit/s links, mean of {args.seeds} seed(s) "
             f"(accuracy: mean [min, max])", "",
             "| stages | setting (activations / gradients) | test acc. compressed | test acc. fp32 | "
             "test loss compressed | test loss fp32 | bytes/step fwd | bytes/step bwd | ms/step |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['stages']} | {r['setting']} | failed | | | | | | |")
            continue
        ca, fa = r["test_accuracy_compressed_range"], r["test_accuracy_fp32_range"]
        lines.append(f"| {r['stages']} | {r['setting']} (`{r['forward']}` / `{r['backward']}`) | "
                     f"{100 * r['test_accuracy_compressed']:.2f}% [{100 * ca[0]:.1f}, {100 * ca[1]:.1f}] | "
                     f"{100 * r['test_accuracy_fp32']:.2f}% [{100 * fa[0]:.1f}, {100 * fa[1]:.1f}] | "
                     f"{r['test_loss_compressed']:.4f} | {r['test_loss_fp32']:.4f} | "
                     f"{r['bytes_forward_per_step']:.0f} | {r['bytes_backward_per_step']:.0f} | "
                     f"{1000 * r['seconds_per_step']:.1f} |")
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "out", "experiments", "pipeline"))
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4], help="pipeline depths (default 2 4)")
    parser.add_argument("--steps", type=int, default=300, help="training steps per run (default 300)")
    parser.add_argument("--hidden", type=int, default=512, help="hidden width (default 512)")
    parser.add_argument("--batch", type=int, default=64, help="rows per step (default 64)")
    parser.add_argument("--rate-mbit", type=float, default=100.0, help="link rate, Mbit/s (default 100)")
    parser.add_argument("--settings", nargs="+", default=None, help="names from SETTINGS (default all)")
    parser.add_argument("--seeds", type=int, default=3,
                        help="model initialisations per setting (default 3); the table shows their mean")
    parser.add_argument("--quick", action="store_true", help="5 settings, 2 stages, 100 steps")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run (default 900)")
    parser.add_argument("--python-path", default=os.path.join(ROOT, "build", "python"),
                        help="where the morse package is (default build/python)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("pipeline_experiment.py: needs root for ip netns and tc; run it with sudo")
    # SIGTERM unwinds like Ctrl-C, so the namespaces are removed.
    signal.signal(signal.SIGTERM, lambda *unused: sys.exit(143))
    settings = [s for s in SETTINGS if (args.settings is None or s[0] in args.settings)]
    if args.quick:
        settings = [s for s in settings if s[0] in QUICK]
        args.stages, args.steps, args.seeds = [2], min(args.steps, 100), 1
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for stages in args.stages:
        with VirtualCluster(stages, args.rate_mbit / 1000.0) as vc:
            for name, forward, backward in settings:
                for seed in range(args.seeds):
                    work = os.path.join(args.out, f"{stages}-{name.replace(' ', '_').replace('%', '')}-{seed}")
                    os.makedirs(work, exist_ok=True)
                    started = time.time()
                    r = run_one(vc, stages, forward, backward, args, work, seed)
                    r.update(stages=stages, setting=name, forward=forward, backward=backward, steps=args.steps,
                             seed=seed)
                    rows.append(r)
                    print(f"{stages} stages, {name}: {r.get('status')} "
                          f"acc {r.get('test_accuracy_compressed', 0):.4f}/{r.get('test_accuracy_fp32', 0):.4f} "
                          f"{1000 * r.get('seconds_per_step', 0):.1f} ms/step ({time.time() - started:.0f} s)",
                          flush=True)
    with open(os.path.join(args.out, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    merged = mean_over_seeds(rows)
    print(report(merged, args, args.out))
    path = plot(merged, args.out)
    if path:
        print(f"plot: {path}")


if __name__ == "__main__":
    main()
