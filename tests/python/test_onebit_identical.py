"""morse.torch.OneBitAdam across 4 workers: after every step (through the
freeze step) every worker holds bit-identical x, m, v, equal to the
single-process simulator fed the gradients the workers computed, with
bias correction and the zero-variance mask on (a parameter no loss uses
stays where it was). Even ranks
overlap pushes with the backward pass, odd ranks do not: the bytes, and so
the results, are the same; so do ranks 1 and 2 with a compute pool
(MORSE_COMPUTE_THREADS) and the others without. state_dict()/load_state_dict() round-trip the
optimizer state, error buffers included. Then all of it again with
clip_grad_norm, which clips every step; and with the script's own
torch.nn.utils.clip_grad_norm_ after backward() instead, which must give
the bits of clip_grad_norm (the simulator runs with it): the averaged
gradient clipped in warmup, each rank's own after the freeze. And under
torch's OneCycleLR, which cycles lr and betas[0] every step, with two
parameter groups of their own beta2: the simulator stepped with the lr,
betas and eps each step's pushes carried."""
import os
import sys
import tempfile

import torch

from harness import (check, check_ranks_match_simulator, clip_in_job, morse_run, one_cycle,  # noqa: E402
                     train_recorded)

STEPS = 12


def worker(out, clip):
    import morse.torch
    # OneCycleLR as users build it: lr up and down, betas[0] the other way
    # (cycle_momentum=True, its default), which OneBitAdam follows step by
    # step and group by group, in warmup and compression alike (design.md
    # 2.1).
    cycling = clip == "one_cycle"
    clip = "none" if cycling else clip
    script = clip.startswith("script")  # the script calls clip_grad_norm_
    clip = clip[len("script"):] if script else clip
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Tanh(), torch.nn.Linear(20, 4))
    # A parameter the loss never uses: its v stays 0, so the zero-variance
    # mask (on by default) has elements to mask after the freeze.
    model.unused = torch.nn.Parameter(torch.full((7,), 0.5))
    rank = int(os.environ["MORSE_RANK"])
    # Ranks 1 and 2 encode and apply on a compute pool of their session
    # (MORSE_COMPUTE_THREADS), the others on their own threads: the same bits.
    os.environ["MORSE_COMPUTE_THREADS"] = "2" if rank in (1, 2) else "0"
    # "one_cycle": two groups, the first layer's with its own beta2, so
    # every step's pushes carry each group's betas.
    params = ([{"params": model[0].parameters(), "betas": (0.9, 0.99)},
               {"params": [*model[2].parameters(), model.unused]}]
              if cycling else model.parameters())
    opt = morse.torch.OneBitAdam(params, lr=0.01, freeze_step=4, block_elems=16,
                                 partition_elems=64, overlap=rank % 2 == 0,
                                 missing_grads="zero",  # the unused parameter (torch 2 zero_grad sets None)
                                 clip_grad_norm=float(clip) if clip != "none" and not script else None)
    def clips(step, flat):  # this rank's own gradient is clipped after the freeze
        check(flat.norm().item() > 2 * float(clip), f"step {step}: the clip would not act")
        if script:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float(clip)).item()
            # the averaged gradient's norm in warmup, this rank's own after
            own = flat.norm().item()
            check((abs(norm - own) <= 1e-5 * own) == (step >= 4),
                  f"step {step}: clip_grad_norm_ returned {norm}, this rank's own norm {own}")

    on_step = None
    if cycling:
        on_step, check_moved = one_cycle(opt, STEPS)
    checksums = train_recorded(opt, model, out, STEPS, features=10, classes=4,
                               on_gradient=clips if clip != "none" else None, on_step=on_step,
                               record_hypers=cycling)
    if cycling:
        check_moved()
    check(torch.equal(model.unused.detach(), torch.full((7,), 0.5)), "a parameter with v = 0 moved")
    # state_dict round trip: the error buffer is in it, a changed state
    # changes the replica, and loading the saved state restores it exactly.
    saved = opt.state_dict()
    check(saved["state"]["step"] == STEPS, "the step is saved")
    check(saved["state"]["worker_error"].abs().sum().item() > 0, "the error buffer is saved")
    changed = {"state": dict(saved["state"], exp_avg=saved["state"]["exp_avg"] * 2),
               "param_groups": saved["param_groups"]}
    opt.load_state_dict(changed)
    check(opt.checksum() != checksums[-1], "loading a different state changes the replica")
    opt.load_state_dict(saved)
    check(opt.checksum() == checksums[-1], "loading the saved state restores it")
    again = opt.state_dict()["state"]
    check(torch.equal(again["worker_error"], saved["state"]["worker_error"]), "error buffer round trip")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(sys.argv[-2], sys.argv[-1])
        sys.exit(0)
    # Then with clip_grad_norm small enough to clip every step: the averaged
    # gradient in warmup, each rank's own after the freeze.
    for clip in ("none", "0.05", "script0.05", "one_cycle"):
        out = tempfile.mkdtemp(prefix="morse-onebit-")
        code, log = morse_run(__file__, 4, 2, out, clip)
        print(log)
        check(code == 0, f"the job failed (clip_grad_norm {clip})")
        if clip.startswith("script"):  # the simulator clips as clip_grad_norm does
            clip_in_job(out, float(clip[len("script"):]))
        check_ranks_match_simulator(out, 4, STEPS)
        print(f"PASS: {STEPS} steps, 4 workers bit-identical to each other and to the simulator "
              + ("(OneCycleLR cycling lr and betas[0])" if clip == "one_cycle"
                 else f"(clip_grad_norm {clip})"))
