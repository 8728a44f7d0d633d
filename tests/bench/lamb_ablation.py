#!/usr/bin/python3
"""Which part of 1-bit LAMB costs convergence: its algorithm (design.md 2.8)
run in torch on the exact averaged gradient, with no compression, beside LAMB
and variants that freeze one thing at a time.

Every variant runs LAMB (convergence.py's Lamb) for the first F of the steps
and keeps each layer's moving average c̄ of LAMB's trust ratio. From there:

  lamb              LAMB all the way (the baseline)
  onebit_lamb       1-bit LAMB's algorithm with exact momentum: v frozen,
                    the fresh variance v', each layer stepping by c̄·f with
                    f the clamped max of sqrt(v̂)/sqrt(v̂') (design.md 2.8)
  frozen_v_and_c    v frozen and each layer stepping by c̄ (no factor)
  frozen_v          v frozen, LAMB's own trust ratio every step
  frozen_c          v live, each layer stepping by c̄

The compression phase's ratio is clamped by 2.1's bound in every variant
that freezes v, as Morse does. It prints each variant's mean held-out loss
over the seeds and its gap to LAMB's. No Morse process runs: this measures
the algorithm, and convergence.py measures Morse.

    tests/bench/lamb_ablation.py [--model attention] [--steps 400] [--seeds 3]
                                 [--lamb-lr-scale 10] [--freeze 0.2]
                                 [--variants lamb,onebit_lamb,...]
"""
import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import convergence  # noqa: E402

VARIANTS = ("lamb", "onebit_lamb", "frozen_v_and_c", "frozen_v", "frozen_c")


class LambVariant(torch.optim.Optimizer):
    """LAMB, then from step `freeze` on the variant's frozen state."""

    def __init__(self, params, lr, freeze, variant, betas=(0.9, 0.999), eps=1e-8,
                 max_coeff=10.0, min_coeff=0.01, coeff_beta=0.9, factor_max=4.0, factor_min=0.5,
                 factor_threshold=0.1):
        super().__init__(params, dict(lr=lr))
        self.freeze, self.variant, self.t = freeze, variant, 0
        self.b1, self.b2, self.eps = betas[0], betas[1], eps
        self.coeff = (min_coeff, max_coeff, coeff_beta)
        self.factor = (factor_min, factor_max, factor_threshold)
        self.bound = max(1.0, (1 - self.b1) / math.sqrt(1 - self.b2))

    def trust_ratio(self, p, u):
        x_norm, u_norm = p.norm().item(), u.norm().item()
        if x_norm > 0 and u_norm > 0:
            return min(max(x_norm / u_norm, self.coeff[0]), self.coeff[1]), True
        return 1.0, False

    @torch.no_grad()
    def step(self):
        t, b1, b2, eps = self.t, self.b1, self.b2, self.eps
        self.t += 1
        frozen = t >= self.freeze and self.variant != "lamb"
        live_v = self.variant in ("lamb", "frozen_c")
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st.update(m=torch.zeros_like(p), v=torch.zeros_like(p), v_fresh=None,
                              c_bar=0.0, f=1.0)
                m, v, g = st["m"], st["v"], p.grad
                # Only 1-bit LAMB's v' needs the momentum before this step.
                m_last = m.clone() if frozen and self.variant == "onebit_lamb" else None
                m.mul_(b1).add_(g, alpha=1 - b1)
                if not frozen or live_v:
                    v.mul_(b2).addcmul_(g, g, value=1 - b2)
                    v_hat = v / (1 - b2 ** (t + 1))
                else:
                    v_hat = v / (1 - b2 ** self.freeze)
                if t + 1 == self.freeze:
                    st["v_fresh"] = v.clone()
                d = v_hat.sqrt() + eps
                u = (m / (1 - b1 ** (t + 1))) / d
                if frozen and not live_v:
                    u.clamp_(-self.bound, self.bound)
                c, moved = self.trust_ratio(p, u)
                if not frozen:
                    if moved:
                        st["c_bar"] = self.coeff[2] * st["c_bar"] + (1 - self.coeff[2]) * c
                elif self.variant in ("frozen_v_and_c", "frozen_c"):
                    c = st["c_bar"]
                elif self.variant == "onebit_lamb":
                    # v' from the gradient the momentum implies (here exactly g).
                    g_implied = (m - b1 * m_last) / (1 - b1)
                    st["v_fresh"].mul_(b2).addcmul_(g_implied, g_implied, value=1 - b2)
                    fresh = (st["v_fresh"] / (1 - b2 ** (t + 1))).sqrt() + eps
                    f_min, f_max, threshold = self.factor
                    f = min(max((d / fresh).max().item(), f_min), f_max)
                    f = min(max(f, st["f"] * (1 - threshold)), st["f"] * (1 + threshold))
                    st["f"] = f
                    c = st["c_bar"] * f
                p.add_(u, alpha=-group["lr"] * c)


def train(task, variant, lr, freeze):
    model = task.model()
    opt = LambVariant(model.parameters(), lr, freeze, variant)
    for step in range(task.steps):
        opt.zero_grad()
        parts = [task.batch(r, step) for r in range(convergence.WORKERS)]
        loss = sum(task.loss(model, x, y) for x, y in parts) / convergence.WORKERS
        loss.backward()
        opt.step()
    return task.evaluate(model)[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="attention", choices=("cnn", "gru", "attention"),
                        help="the convergence benchmark's model (default attention)")
    parser.add_argument("--steps", type=int, default=400, help="training steps (default 400)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 1..N, means reported (default 3)")
    parser.add_argument("--lamb-lr-scale", type=float, default=10.0, metavar="K",
                        help="lr as K times the model's Adam lr (default 10)")
    parser.add_argument("--freeze", type=float, default=0.2, metavar="F",
                        help="the freeze as a fraction of the steps (default 0.2)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"any of {', '.join(VARIANTS)} (default: all)")
    args = parser.parse_args()
    variants = args.variants.split(",")
    for bad in [v for v in variants if v not in VARIANTS]:
        parser.error(f"unknown variant {bad!r}: one of {', '.join(VARIANTS)}")
    if args.steps < 1 or args.seeds < 1:
        parser.error("--steps and --seeds must be at least 1")
    if not 0 < args.freeze <= 1 or not args.lamb_lr_scale > 0:
        parser.error("--freeze must be in (0, 1] and --lamb-lr-scale positive")
    torch.set_num_threads(1)
    lr = args.lamb_lr_scale * convergence.LR[args.model]
    freeze = max(1, int(args.steps * args.freeze))
    print(f"{args.model}, {args.steps} steps, lr {lr:g}, freeze at step {freeze}, "
          f"seeds 1..{args.seeds}, exact averaged gradients (no compression)")
    base = None
    for variant in (["lamb"] if "lamb" not in variants else []) + variants:
        losses = [train(convergence.Task(args.model, args.steps, seed), variant, lr, freeze)
                  for seed in range(1, args.seeds + 1)]
        mean = sum(losses) / len(losses)
        if variant == "lamb":
            base = mean
        print(f"{variant:16} held-out loss {mean:.4f}  gap to LAMB {100 * (mean - base) / base:+6.2f}%  "
              f"seeds {' '.join(f'{l:.4f}' for l in losses)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
