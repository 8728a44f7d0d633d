"""Wrong use of morse.torch gets a clear Python exception, not a crash:
non-float32 parameters, no credentials, no servers reachable (after the
configured timeout), mismatched parameter shapes across workers, and step()
before every worker joined."""
import os
import sys
import tempfile
import time
import warnings

import torch

from harness import check, expect, free_port, morse_run, server

os.environ["MORSE_INSECURE"] = "1"  # the servers here are plaintext on loopback



def _raised(call):
    """The exception call() raises (None if none)."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 (the test looks at any)
        return e
    return None


def config_file(text):
    f = tempfile.NamedTemporaryFile("w", suffix=".textproto", delete=False)
    f.write(text)
    f.close()
    return f.name


def worker_mismatch():
    import morse.torch
    rank = int(os.environ["MORSE_RANK"])
    model = torch.nn.Linear(4, 3 + rank)  # rank 1 builds a different model
    try:
        opt = morse.torch.OneBitAdam(model.parameters())
        opt.step()
    except morse.torch.MorseError as e:
        print(f"MISMATCH rank {rank}: {e}")
        sys.exit(3)


def worker_lr():
    import morse.torch
    rank = int(os.environ["MORSE_RANK"])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = morse.torch.Adam(model.parameters(), lr=0.01)
    try:
        for step in range(3):
            if step == 1:
                opt.param_groups[0]["lr"] = 0.01 * (rank + 1)  # the ranks disagree
            opt.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
    except morse.torch.MorseError as e:
        print(f"LR rank {rank}: {e}")
        sys.exit(3)


def worker_abort():
    """Rank 1's gradient turns Inf at step 2; every rank must get a
    MorseError at once (not wait out the recovery timeout for rank 1's
    pushes), rank 0's naming rank 1 and its reason."""
    import morse.torch
    rank = int(os.environ["MORSE_RANK"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    opt = morse.torch.OneBitAdam(model.named_parameters(), freeze_step=1)
    start = time.time()
    try:
        for step in range(5):
            opt.zero_grad()
            loss = model(torch.ones(2, 4)).sum()
            if rank == 1 and step == 2:
                loss = loss * float("inf")  # the overlap hooks push Inf: backward() raises
            loss.backward()
            opt.step()
    except morse.torch.MorseError as e:
        print(f"CAUGHT rank {rank} after {time.time() - start:.1f} s: {e}", flush=True)
        time.sleep(1)  # let the other rank print before morse-run stops it
        sys.exit(0)
    print(f"NO ERROR rank {rank}", flush=True)


def main():
    import morse.torch
    from morse import MorseError
    args = dict(rank=0, world_size=1, servers=["127.0.0.1:1"])
    expect(TypeError, "float32", lambda: morse.torch.OneBitAdam(
        [torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))], **args))
    expect(ValueError, "no parameters", lambda: morse.torch.Adam([], **args))
    # A parameter listed twice (torch.optim warns, and steps it twice).
    shared = torch.nn.Linear(3, 2)
    expect(ValueError, "parameter 2 (2, 3) is the same tensor as parameter 0 (2, 3): list each "
           "parameter once", lambda: morse.torch.Adam(list(shared.parameters()) + [shared.weight],
                                                        **args))
    # In two groups: torch's own check.
    expect(ValueError, "more than one parameter group", lambda: morse.torch.OneBitAdam(
        [{"params": [shared.weight]}, {"params": [shared.bias, shared.weight]}], **args))
    expect(ValueError, "only with broadcast_buffers=True", lambda: morse.torch.Adam(
        torch.nn.Linear(3, 2).parameters(), buffers=[torch.zeros(2)], broadcast_buffers=False, **args))
    # Parameter groups with betas and eps of their own train apart
    # (test_adam_matches_torch's group_betas, test_onebit_identical's,
    # test_zero_one's, test_onebit_lamb's), but with schedule="cosine",
    # whose groups are one segment with one update rule.
    expect(ValueError, "param_groups[1] has betas (0.8, 0.999), param_groups[0] (0.9, 0.999)",
           lambda: morse.torch.OneBitLamb(
               [{"params": [torch.nn.Parameter(torch.zeros(3))]},
                {"params": [torch.nn.Parameter(torch.zeros(2))], "betas": (0.8, 0.999)}],
               schedule="cosine", steps=10, **args))
    expect(ValueError, "schedule='cosine' sets one lr", lambda: morse.torch.OneBitAdam(
        [{"params": [torch.nn.Parameter(torch.zeros(3))], "weight_decay": 0.1},
         {"params": [torch.nn.Parameter(torch.zeros(2))], "weight_decay": 0.0}],
        schedule="cosine", steps=10, **args))
    expect(ValueError, "feedback='ef' has none", lambda: morse.torch.Adam(
        torch.nn.Linear(3, 2).parameters(), feedback="ef", feedback_beta=0.5, **args))
    # torch.optim.Adam's variants Morse has no counterpart for, refused by
    # name (its choices of implementation, foreach, fused and capturable,
    # are accepted: test_adam_matches_torch's "constant"); DeepSpeed's
    # OnebitAdam arguments as ZeroOneAdam's and OnebitLamb's (its transport
    # settings accepted, its variants refused).
    linear = lambda: torch.nn.Linear(3, 2).parameters()  # noqa: E731
    expect(ValueError, "Adam does not support the AMSGrad variant", lambda: morse.torch.AdamW(
        linear(), 1e-3, (0.9, 0.999), 1e-8, 0.01, True, **args))  # amsgrad, torch's 6th
    expect(ValueError, "maximize=True is not supported", lambda: morse.torch.Adam(
        linear(), maximize=True, **args))
    expect(ValueError, "differentiable=True is not supported", lambda: morse.torch.Adam(
        linear(), differentiable=True, **args))
    expect(ValueError, "Morse's weight decay is decoupled", lambda: morse.torch.Adam(
        linear(), weight_decay=0.1, decoupled_weight_decay=False, **args))
    expect(TypeError, "AdamW takes no decoupled_weight_decay", lambda: morse.torch.AdamW(
        linear(), decoupled_weight_decay=True, **args))
    for bad, words in ((dict(amsgrad=True), "1-bit Adam does not support the AMSGrad variant"),
                       (dict(eps_inside_sqrt=True), "eps_inside_sqrt=True is not supported"),
                       (dict(max_grad_norm=1.0), "DeepSpeed's OnebitAdam ignores it")):
        expect(ValueError, words, lambda: morse.torch.OneBitAdam(linear(), **bad, **args))
    # DeepSpeed's tutorial's OneBitAdam params, and torch's choices of
    # implementation: accepted, so the constructor gets as far as the
    # credentials (none given here).
    expect(MorseError, "--insecure", lambda: morse.torch.OneBitAdam(
        linear(), **dict(lr=4e-4, freeze_step=23000, cuda_aware=False, comm_backend_name="nccl"),
        security={}, **args))
    expect(MorseError, "--insecure", lambda: morse.torch.AdamW(
        linear(), lr=torch.tensor(1e-3), fused=True, foreach=False, capturable=True,
        security={}, **args))
    for bad in (-1.0, 0, float("nan"), float("inf"), "big"):
        expect(ValueError, "a positive, finite max_norm", lambda: morse.torch.Adam(
            torch.nn.Linear(3, 2).parameters(), clip_grad_norm=bad, **args))
    # No credentials and no insecure: refused, saying what to pass.
    expect(MorseError, "--insecure", lambda: morse.torch.OneBitAdam(
        torch.nn.Linear(3, 2).parameters(), security={}, **args))
    expect(ValueError, "unknown security option", lambda: morse.torch.OneBitAdam(
        torch.nn.Linear(3, 2).parameters(), security={"tls_cafile": "x"}, **args))

    # No server listens on this port: the connect timeout (2 s) ends the wait.
    quick = config_file("workers: 1\nshards: 1\nexternal {}\ntimeouts { connect_seconds: 2 }\n")
    start = time.time()
    expect(MorseError, "DEADLINE_EXCEEDED", lambda: morse.torch.OneBitAdam(
        torch.nn.Linear(3, 2).parameters(), rank=0, world_size=1,
        servers=[f"127.0.0.1:{free_port()}"], config=quick))
    check(time.time() - start < 15, "the connect timeout was not honoured")
    # A MORSE_MALLOC that is neither daemon nor default: refused before anything connects.
    os.environ["MORSE_MALLOC"] = "huge"
    try:
        expect(MorseError, "MORSE_MALLOC=huge: daemon (the default) or default",
               lambda: morse.torch.OneBitAdam(torch.nn.Linear(3, 2).parameters(), rank=0, world_size=1,
                                              servers=[f"127.0.0.1:{free_port()}"], config=quick))
    finally:
        del os.environ["MORSE_MALLOC"]

    # step() while rank 1 never joins.
    base = config_file("workers: 2\nshards: 1\nexternal {}\ntimeouts { connect_seconds: 2 }\n")
    with server(base) as address:
        opt = morse.torch.OneBitAdam(torch.nn.Linear(3, 2).parameters(), rank=0, world_size=2,
                                     servers=[address], config=base)
        expect(MorseError, "only 1 of 2 workers joined", opt.step)

    # The session's batched send (what backward()'s hooks call): outside a
    # step, an unknown partition, or a CUDA stream for a host session are
    # refused with their canonical codes, and the step still works after.
    base = config_file("workers: 1\nshards: 1\nexternal {}\n")
    with server(base) as address:
        model = torch.nn.Linear(3, 2)
        opt = morse.torch.Adam(model.parameters(), rank=0, world_size=1, servers=[address],
                               config=base, overlap=False)
        session = opt._session
        expect(MorseError, "FAILED_PRECONDITION: no step in progress",
               lambda: session.send_partitions([0]))
        model(torch.ones(4, 3)).sum().backward()
        opt.step()
        session.begin(opt._flat_grad.numpy())
        expect(MorseError, "INVALID_ARGUMENT: no partition 7", lambda: session.send_partitions([7]))
        expect(MorseError, "FAILED_PRECONDITION: the session keeps its model on the host",
               lambda: session.send_partitions([0], stream=1))
        session.send_partitions([])  # nothing to send is no error
        session.send_partitions([0])
        session.finish()
        check(opt.step_index == 2, f"the step after the refusals completed: {opt.step_index}")
        # A torch.optim state_dict without Adam's moments (an SGD's; Adam's
        # and AdamW's load: test_torch_state), or no state dict at all:
        # refused, saying what load_state_dict takes.
        reference = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.ones(4, 3)).sum().backward()
        reference.step()
        expect(ValueError, "no exp_avg and exp_avg_sq (its state holds ['momentum_buffer'])",
               lambda: opt.load_state_dict(reference.state_dict()))
        expect(ValueError, "load_state_dict takes what this optimizer's state_dict() returned",
               lambda: opt.load_state_dict(None))
        expect(ValueError, "without a state dict", lambda: opt.load_state_dict({}))
        opt.zero_grad()
        # DiLoCo's calls, on an optimizer without inner steps.
        import numpy as np
        local = opt._flat.detach().numpy().copy()
        kept = local.copy()
        expect(MorseError, "FAILED_PRECONDITION: merge_outer is for an optimizer with inner steps "
               "(diloco); this job's optimizer is adam", lambda: session.merge_outer(0, local))
        check(np.array_equal(local, kept), "a refused merge changed the parameters")
        expect(MorseError, "FAILED_PRECONDITION: inner_steps_before is for an optimizer with inner",
               lambda: session.inner_steps_before(1))

    # A non-finite gradient: the error names the parameter, the step and
    # phase, and what to try.
    base = config_file("workers: 1\nshards: 1\nexternal {}\n")
    with server(base) as address:
        model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
        opt = morse.torch.OneBitAdam(model.named_parameters(), freeze_step=1, rank=0, world_size=1,
                                     servers=[address], config=base, overlap=False)
        model(torch.ones(4, 3)).sum().backward()
        opt.step()  # warmup
        opt.zero_grad()
        model(torch.ones(4, 3)).sum().backward()
        model[1].weight.grad.fill_(float("inf"))
        expect(MorseError, "at step 1 (compression phase): non-finite values in 1.weight", opt.step)

    # fp16 loss scaling (torch.amp.GradScaler; torch 1.13's runs on CUDA
    # only: test_grad_scaler runs it on the CPU with its CUDA kernels
    # written out): a step whose gradients overflowed is skipped (on every
    # rank: test_grad_scaler) and the scale backs off; one that did not is
    # unscaled in .grad and taken. A step(grad_scaler=...) from a scaler
    # whose scale() did not tell the optimizer (its pushes left before
    # anything knew of an overflow) is refused, saying to train in bf16; a
    # plain step() after it is a step.
    scaler_type = getattr(getattr(torch, "amp", None), "GradScaler", None)
    with server(base) as address:
        model = torch.nn.Linear(3, 2)
        opt = morse.torch.Adam(model.parameters(), rank=0, world_size=1, servers=[address],
                               config=base)
        if scaler_type is not None:
            scaler = scaler_type("cpu", init_scale=1024.0)
            scaler.scale(model(torch.ones(4, 3)).sum() * float("inf")).backward()
            scaler.step(opt)
            scaler.update()
            check(opt.step_index == 0 and scaler.get_scale() == 512.0,
                  f"an overflowing step: step_index {opt.step_index}, scale {scaler.get_scale()}")
            opt.zero_grad()
            scaler.scale(model(torch.ones(4, 3)).sum()).backward()
            scaler.step(opt)
            scaler.update()
            check(opt.step_index == 1 and bool((model.weight.grad == 4.0).all()),
                  f"a step GradScaler drove: step_index {opt.step_index}, .grad "
                  f"{model.weight.grad.tolist()} (4.0 unscaled)")
            print("ok: GradScaler skipped the overflowing step and took the next, unscaled")
        else:
            print(f"(torch {torch.__version__} has no torch.amp.GradScaler: test_grad_scaler "
                  "runs its torch.cuda.amp.GradScaler on the CPU)")
        opt.zero_grad()
        model(torch.ones(4, 3)).sum().backward()
        before = opt.step_index
        expect(ValueError, "Train in bf16", lambda: opt.step(grad_scaler=object()))
        opt.step()  # a step that no GradScaler drives is a step
        check(opt.step_index == before + 1, "a plain step() after the refusal did not run")
        expect(TypeError, "unexpected keyword arguments ['lr']", lambda: opt.step(lr=0.1))

    # A parameter that gets no gradient in a step (zero_grad(set_to_none=True)
    # and a loss that does not use it): torch.optim would skip it, Morse
    # cannot, so it says so, naming it; missing_grads="zero" accepts it.
    base = config_file("workers: 1\nshards: 1\nexternal {}\n")
    for overlap in (True, False):
        for missing in ("raise", "zero"):
            with server(base) as address:
                model = torch.nn.ModuleDict({"used": torch.nn.Linear(3, 2), "spare": torch.nn.Linear(3, 2)})
                opt = morse.torch.Adam(model.named_parameters(), rank=0, world_size=1,
                                       servers=[address], config=base, overlap=overlap,
                                       missing_grads=missing)
                opt.zero_grad(set_to_none=True)
                model["used"](torch.ones(4, 3)).sum().backward()
                if missing == "raise":
                    expect(MorseError, "spare.weight, spare.bias got no gradient in step 0", opt.step)
                else:
                    opt.step()
                check(model["spare"].weight.grad is not None, "the views are attached again")
    expect(ValueError, "missing_grads='skip'", lambda: morse.torch.Adam(
        torch.nn.Linear(3, 2).parameters(), missing_grads="skip", **args))

    # Gradients edited after clip_grad_norm_ otherwise than by scaling a
    # parameter's whole gradient (an add_, through .data too, which moves no
    # version counter, or part of a parameter): the step trains on .grad as
    # the edit left it, as DDP's does on its clipped average. After the clip
    # .grad holds the clipped average (one rank here: its own gradient,
    # clipped), and step() sends the edited one to the shards (design.md
    # 2.6, "Edits after the clip"): torch's AdamW after torch's clip and the
    # same edit, the shards' mirrors alike. (Until session 67 refused after
    # the step; test_adam_matches_torch's edit_any: 2 ranks against DDP.)
    base = config_file("workers: 1\nshards: 1\nexternal {}\n")
    torch_clip = morse.torch._TORCH_CLIP_GRAD_NORM
    for edit in (lambda g: g.add_(0.5), lambda g: g.data.add_(0.5), lambda g: g[0].mul_(0.5)):
        with server(base) as address:
            model = torch.nn.Linear(3, 2)
            reference = torch.nn.Linear(3, 2)
            reference.load_state_dict(model.state_dict())
            opt = morse.torch.Adam(model.named_parameters(), lr=0.01, weight_decay=0.0, rank=0,
                                   world_size=1, servers=[address], config=base)
            ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01, weight_decay=0.0)
            for m in (model, reference):
                # Columns of the weight's gradient apart (18, 22, 26): an
                # add_ is no factor of it.
                m(torch.arange(12.0).view(4, 3)).sum().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            torch_clip(reference.parameters(), 0.01)
            shown = max(float((p.grad - q.grad).abs().max() / q.grad.abs().max())
                        for p, q in zip(model.parameters(), reference.parameters()))
            check(shown <= 1e-6, f".grad after the clip is {shown:.1e} (relative) from torch's "
                  "clipped gradient")
            edit(model.weight.grad)
            edit(reference.weight.grad)
            opt.step()
            ref_opt.step()
            check(opt.step_index == 1, "the step did not run")
            diff = max(float((p - q).abs().max())
                       for p, q in zip(model.parameters(), reference.parameters()))
            check(diff <= 1e-6, f"an edit after clip_grad_norm_ trained {diff:.1e} from torch's")
            check(opt._session.holds_shards_model(), "the shard's mirror differs after the edit")
    print("PASS: an add_, an add_ through .data and a row's mul_ after clip_grad_norm_ train as "
          "torch's clip and the same edit, the shard's mirror alike")

    # A non-contiguous parameter (a transpose made a Parameter, as DDP
    # accepts): it becomes a contiguous view of the flat buffer with the
    # same values, and trains as torch's AdamW trains it (refused until
    # session 67).
    with server(base) as address:
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(3, 4).t())
        reference = torch.nn.Parameter(w.detach().clone().t().contiguous().t())
        check(not w.is_contiguous() and not reference.is_contiguous(), "a transposed parameter")
        opt = morse.torch.Adam([w], lr=0.01, weight_decay=0.0, rank=0, world_size=1,
                               servers=[address], config=base)
        ref_opt = torch.optim.AdamW([reference], lr=0.01, weight_decay=0.0)
        check(torch.equal(w, reference), "the parameter's values after building the optimizer")
        for step in range(3):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
            for p_, o in ((w, opt), (reference, ref_opt)):
                o.zero_grad()
                (x @ p_).square().mean().backward()
                o.step()
        diff = float((w - reference).abs().max())
        check(diff <= 1e-6, f"a non-contiguous parameter trained {diff:.1e} from torch's")
    print("PASS: a non-contiguous parameter trains as torch's AdamW trains it")

    def onebit_linear(address, saved=None):
        """A 3x2 Linear (seed 0) and its OneBitAdam (freeze_step 1, one rank
        on `address`), both resumed from `saved` (their state_dicts) if given."""
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        if saved is not None:
            model.load_state_dict(saved[0])
        opt = morse.torch.OneBitAdam(model.parameters(), freeze_step=1, rank=0, world_size=1,
                                     servers=[address], config=base)
        if saved is not None:
            opt.load_state_dict(saved[1])
        return model, opt

    # In a compressing step (each rank's own gradient, pushed at step())
    # clip_grad_norm_ is torch's own on .grad, in place, and step() pushes
    # .grad as it finds it: edits after the clip train as torch's order
    # gives them (DeepSpeed's rule). Every gradient halved after
    # clip_grad_norm_(.., 0.01) trains bit for bit as clip_grad_norm_(..,
    # 0.005) (factors a power of 2 apart); an add_ or a row's mul_ after it
    # as torch's own clip_grad_norm_ followed by the same edit (to float
    # rounding: torch sums the norm in another order), and unlike the
    # edit made before the clip. .grad after the clip is torch's.
    torch_clip = morse.torch._TORCH_CLIP_GRAD_NORM
    edits = {"add": lambda g: g.add_(0.5), "row": lambda g: g[0].mul_(0.5)}
    trained = {}
    for plan in ("halved", "half_norm", "add", "add_torch", "add_first", "row", "row_torch"):
        with server(base) as address:
            model, opt = onebit_linear(address)
            for step in range(3):
                opt.zero_grad()
                model(torch.ones(4, 3)).sum().backward()
                if step == 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
                    opt.step()
                    continue
                edit = edits.get(plan.split("_")[0])
                if plan == "add_first":
                    edit(model.weight.grad)
                if plan.endswith("_torch"):
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")  # (torch's clip is an edit to Morse)
                        torch_clip(model.parameters(), 0.01)
                        edit(model.weight.grad)
                        opt.step()
                    continue
                expected = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
                for q, p in zip(expected, model.parameters()):
                    q.grad = p.grad.clone()
                torch_clip(expected, 0.005 if plan == "half_norm" else 0.01)
                torch.nn.utils.clip_grad_norm_(model.parameters(),
                                               0.005 if plan == "half_norm" else 0.01)
                got = [p.grad for p in model.parameters()]
                check(all(torch.allclose(g, q.grad, rtol=1e-6, atol=0)
                          for g, q in zip(got, expected)) and float(got[0].abs().max()) < 0.1,
                      f"{plan}: .grad after clip_grad_norm_ in a compressing step is not torch's")
                if plan == "halved":
                    for p in model.parameters():
                        p.grad.mul_(0.5)
                elif edit is not None and plan != "add_first":
                    edit(model.weight.grad)
                opt.step()
            trained[plan] = torch.cat([p.detach().flatten() for p in model.parameters()])
    check(torch.equal(trained["halved"], trained["half_norm"]),
          "a compressing step's gradients halved after clip_grad_norm_ are not those of half the "
          f"max_norm: {(trained['halved'] - trained['half_norm']).abs().max()}")
    for edit in edits:
        apart = float((trained[edit] - trained["add_first"]).abs().max())
        off = float((trained[edit] - trained[f"{edit}_torch"]).abs().max())
        check(off <= 1e-6 and (edit != "add" or apart > 1e-4),
              f"{edit} after clip_grad_norm_ in a compressing step: {off} from torch's order, "
              f"{apart} from the edit before the clip")
        print(f"PASS: {edit} after clip_grad_norm_ in a compressing step: {off:.1e} from torch's "
              f"order, {apart:.1e} from the edit made before the clip")
    print("PASS: gradients halved after clip_grad_norm_ in a compressing step train bit for bit "
          "as half the max_norm; .grad after the clip is torch's")
    # The same in the first step of an optimizer resumed in the compression
    # phase (its clip begins the step, as a resumed Trainer's does): an add_
    # after the clip, bit for bit as in the run it resumes.
    def compressing_run(steps, saved=None):
        model, opt = onebit_linear(address, saved)
        for step in steps:
            opt.zero_grad()
            model(torch.full((4, 3), 1.0 + step)).sum().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            if step == 2:
                model.weight.grad.add_(0.5)
            opt.step()
        return model, opt
    with server(base) as address:
        whole, _ = compressing_run(range(3))
    with server(base) as address:
        model, opt = compressing_run(range(2))
        saved = ({k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict())
    with server(base) as address:
        resumed, _ = compressing_run([2], saved)
    check(all(torch.equal(a, b) for a, b in zip(whole.parameters(), resumed.parameters())),
          "an add_ after clip_grad_norm_ in a resumed optimizer's first (compressing) step differs "
          "from the run it resumes")
    print("PASS: an add_ after clip_grad_norm_ in a resumed optimizer's first step, a compressing "
          "one, bit for bit as in the run it resumes")

    # Several calls in a step compose on the averaged gradient
    # (test_adam_matches_torch's clip_twice and clip_orders), and in a compressing step too, where each
    # rank clips its own gradient and pushes at step(): against one clip by
    # the max_norm with the product of the factors (to float rounding: that
    # max_norm is worked out here from torch's norm), and unlike the first
    # clip alone. A norm of another order there is this rank's own.
    moved = {}
    for plan in ("twice", "equivalent", "first"):
        with server(base) as address:
            model, opt = onebit_linear(address)
            for step in range(2):
                opt.zero_grad()
                model(torch.ones(4, 3)).sum().backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
                if step == 0:  # the warmup: the averaged gradient's clips compose
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-2)
                    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3))
                    check(abs(norm - 1e-2) < 1e-6, f"the second clip saw {norm}, not the first's 0.01")
                    opt.step()
                    continue
                own = torch.cat([p.grad.flatten() for p in model.parameters()]).double()
                if plan == "twice":
                    check(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)) > 0,
                          "a call that does not clip is fine in a compressing step")
                    for order in (1.0, float("inf"), 3.0, 0.5):
                        # torch's: each parameter's norm, then theirs.
                        want = float(torch.linalg.vector_norm(torch.stack(
                            [torch.linalg.vector_norm(p.grad.double(), order)
                             for p in model.parameters()]), order))
                        got = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9,
                                                                   norm_type=order))
                        check(abs(got - want) <= 1e-6 * want,
                              f"norm_type={order} in a compressing step: {got}, this rank's own {want}")
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-2)
                    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3))
                    check(abs(norm - 1e-2) < 1e-6,
                          f"a compressing step's second clip saw {norm}, not the first's 0.01")
                elif plan == "equivalent":
                    n = float(own.norm())
                    first = 1e-2 / (n + 1e-6)
                    second = 1e-3 / (n * first + 1e-6)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), first * second * (n + 1e-6))
                else:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-2)
                opt.step()
            moved[plan] = torch.cat([p.detach().flatten() for p in model.parameters()])
    close = float((moved["twice"] - moved["equivalent"]).abs().max())
    apart = float((moved["twice"] - moved["first"]).abs().max())
    check(apart > 0 and close <= 1e-3 * apart,
          f"two clips in a compressing step: {close} from one clip by their product, {apart} from "
          "the first alone")
    # Part of the parameters in a compressing step: this rank's own
    # gradient of those, clipped in place as torch's own clip_grad_norm_
    # leaves it (the averaging steps' clip pieces: test_adam_matches_torch's
    # clip_part), and its pushes take it so: unlike no clip.
    parts = {}
    for plan in ("part", "none"):
        with server(base) as address:
            model, opt = onebit_linear(address)
            for step in range(3):
                opt.zero_grad()
                model(torch.ones(4, 3)).sum().backward()
                if step == 0 or plan == "none":
                    # The norm logged: the steps begin with the workers' clipping.
                    torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
                    opt.step()
                    continue
                want = [p.grad.clone() for p in model.parameters()]
                norm = float(want[0].double().norm())
                want[0] *= torch.tensor(min(1.0, 1e-3 / (norm + 1e-6)), dtype=torch.float32)
                got = float(torch.nn.utils.clip_grad_norm_([model.weight], 1e-3))
                check(abs(got - norm) <= 1e-6 * norm, f"a part's norm {got}, torch's {norm}")
                opt.step()
                check(all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want)),
                      "a compressing step's clip of part of the model: .grad is not torch's")
            parts[plan] = torch.cat([p.detach().flatten() for p in model.parameters()])
    check(not torch.equal(parts["part"], parts["none"]), "the clip of a part changed nothing")
    # Other tensors still go to torch's own clip_grad_norm_.
    other = torch.nn.Parameter(torch.ones(4))
    other.grad = torch.full((4,), 2.0)
    check(abs(float(torch.nn.utils.clip_grad_norm_([other], 1.0)) - 4.0) < 1e-6
          and abs(float(other.grad.norm()) - 1.0) < 1e-5, "torch's clip on other tensors")
    print(f"PASS: clip_grad_norm_ misuse refused; a part clipped in a compressing step as torch's; "
          f"two clips in a compressing step {close:.2e} from "
          f"one by their product, {apart:.2e} from the first alone; other tensors clipped by torch")

    # Edits after backward() that leave every bit as it was (clip_grad_norm_
    # below max_norm; Hugging Face Trainer logs the norm so every step) are
    # no edits: the run is bit-identical to one without them (issue 41).
    sums = {}
    for noop in (False, True):
        with server(base) as address:
            torch.manual_seed(1)
            model = torch.nn.Linear(3, 2)
            opt = morse.torch.Adam(model.parameters(), rank=0, world_size=1, servers=[address],
                                   config=base)
            for step in range(4):
                opt.zero_grad()
                model(torch.full((4, 3), float(step + 1))).pow(2).sum().backward()
                if noop:
                    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
                    check(float(norm) > 0, "clip_grad_norm_ returns the norm")
                    model.weight.grad.mul_(1.0)
                opt.step()
            sums[noop] = opt.checksum()
    check(sums[True] == sums[False], "clip_grad_norm_ that did not clip changed the run")
    print("PASS: edits after backward() that keep every bit run bit-identical to none")

    # Morse's own schedule and a changed param_groups entry: refused.
    with server(base) as address:
        model = torch.nn.Linear(3, 2)
        opt = morse.torch.Adam(model.parameters(), rank=0, world_size=1, servers=[address],
                               config=base, schedule="cosine", steps=10)
        opt.param_groups[0]["weight_decay"] = 0.1
        model(torch.ones(4, 3)).sum().backward()
        expect(ValueError, "the job's schedule sets them", opt.step)
    # ... and two groups built alike, one set apart: with Morse's schedule
    # they train as one segment (with torch's, test_model_setup's
    # groups_apart trains them apart).
    with server(base) as address:
        model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
        opt = morse.torch.Adam([{"params": model[0].parameters()}, {"params": model[1].parameters()}],
                               rank=0, world_size=1, servers=[address], config=base,
                               schedule="cosine", steps=10)
        opt.param_groups[1]["lr"] = 0.5
        model(torch.ones(4, 3)).sum().backward()
        expect(ValueError, "with schedule='cosine' (one lr for the whole model) they train as one "
               "segment", opt.step)

    # betas and eps given by the only group (in place of the arguments) are
    # the job's: bit for bit as the same values given as arguments.
    sums = {}
    for how in ("group", "args", "default"):
        with server(base) as address:
            torch.manual_seed(1)
            model = torch.nn.Linear(3, 2)
            rule = dict(betas=(0.8, 0.99), eps=1e-4)
            params = [dict(params=model.parameters(), **rule)] if how == "group" else model.parameters()
            opt = morse.torch.Adam(params, rank=0, world_size=1, servers=[address], config=base,
                                   **(rule if how == "args" else {}))
            for step in range(4):
                opt.zero_grad()
                model(torch.full((4, 3), float(step + 1))).pow(2).sum().backward()
                opt.step()
            sums[how] = opt.checksum()
    check(sums["group"] == sums["args"], "the group's own betas and eps were not the job's")
    check(sums["group"] != sums["default"], "betas and eps changed nothing")
    print("PASS: a group's own betas and eps are the job's")
    # betas changed after the optimizer was built: every optimizer follows
    # them (test_adam_matches_torch's one_cycle, test_onebit_identical's,
    # test_zero_one's, test_onebit_lamb's), but with Morse's own schedule,
    # which applies the job's, so there the change is refused, never
    # ignored: as the step begins, and with overlap in the backward() that
    # pushes.
    with server(base) as address:
        model = torch.nn.Linear(3, 2)
        opt = morse.torch.OneBitLamb(model.parameters(), rank=0, world_size=1, schedule="cosine",
                                     steps=10, freeze_step=5, servers=[address], config=base)
        model(torch.ones(4, 3)).sum().backward()
        opt.param_groups[0]["betas"] = (0.85, 0.999)
        expect(ValueError, "but the optimizer was built with (0.9, 0.999): with schedule='cosine', "
               "OneBitLamb's betas and eps are the job's update rule", opt.step)
        check("needs schedule='constant'" in str(_raised(opt.step)),
              "the refusal names schedule='constant'")
        opt.param_groups[0]["betas"] = (0.9, 0.999)
        opt.step()
        opt.param_groups[0]["eps"] = 1e-3
        opt.zero_grad()
        expect(ValueError, "param_groups[0] has eps 0.001, but the optimizer was built with 1e-08",
               lambda: model(torch.ones(4, 3)).sum().backward())
    print("PASS: changed betas and eps are refused with schedule='cosine'")
    # Adam follows betas, read as the step begins: one changed after the
    # pushes left (between backward() and step()) applies from the next
    # step, with a warning naming what the step used, as for lr.
    with server(base) as address:
        model = torch.nn.Linear(3, 2)
        opt = morse.torch.Adam(model.parameters(), rank=0, world_size=1, servers=[address],
                               config=base)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(3):
                opt.zero_grad()
                model(torch.ones(4, 3)).sum().backward()
                if step == 1:
                    opt.param_groups[0]["betas"] = (0.5, 0.999)
                opt.step()
        said = [str(w.message) for w in caught if "betas/eps changed" in str(w.message)]
        check(len(said) == 1 and "in step 1 " in said[0],
              f"one warning of the late betas, naming step 1: {said}")

    # Ranks that set different learning rates.
    code, out = morse_run(__file__, 2, 1, "lr", timeout=120)
    print(out[-2000:])
    check(code != 0, "different learning rates should fail the job")
    check("every worker must use the same learning rate and weight decay" in out,
          "the disagreement is named")

    # One rank's step fails: every rank's script gets a MorseError promptly,
    # naming the failing rank and why (the shards stop the job).
    start = time.time()
    code, out = morse_run(__file__, 2, 1, "abort", timeout=120)
    print(out[-3000:])
    check("CAUGHT rank 1" in out and "not finite" in out, "rank 1 reports its non-finite step")
    check("CAUGHT rank 0" in out and "rank 1 stopped the job at step 2" in out,
          "rank 0 gets a MorseError naming rank 1 and its reason")
    check("NO ERROR" not in out, "no rank finishes the job")
    check(time.time() - start < 60, "the other rank learned at once, not after the recovery timeout")

    # Different models on different ranks.
    code, out = morse_run(__file__, 2, 1, "mismatch",
                          config=config_file("timeouts { connect_seconds: 3 }\n"), timeout=120)
    print(out)
    check(code != 0, "the job should fail")
    check("every worker must build the same model" in out, "the shape mismatch is named")
    print("PASS")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        {"mismatch": worker_mismatch, "lr": worker_lr,
         "abort": worker_abort}[sys.argv[-1]]()
        sys.exit(0)
    main()
