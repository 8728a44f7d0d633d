"""libmorse (worker/python/capi.h) through ctypes.

The library is found beside this file, or at $MORSE_LIBRARY. ctypes drops
the GIL during every call, so a blocking exchange never stalls other Python
threads (the autograd hooks push from the backward pass's thread).
"""
import ctypes
import os

__all__ = ["Boundary", "Link", "MorseError", "Session", "Simulator", "cuda_device", "library_path"]

_CAPI_VERSION = 20  # libmorse's MORSE_CAPI_VERSION (worker/python/capi.h)
_CODES = ["OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
          "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
          "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
          "UNAUTHENTICATED"]


class MorseError(RuntimeError):
    """A failure inside Morse; str() starts with the canonical code's name
    ("DEADLINE_EXCEEDED: ..."), which is also `.code`."""

    def __init__(self, message):
        super().__init__(message)
        self.code = message.split(":", 1)[0]


class _Traffic(ctypes.Structure):
    _fields_ = [("bytes_up", ctypes.c_uint64), ("bytes_down", ctypes.c_uint64),
                ("encode_seconds", ctypes.c_double), ("apply_seconds", ctypes.c_double),
                ("retries", ctypes.c_uint64)]


def library_path():
    return os.environ.get("MORSE_LIBRARY") or os.path.join(os.path.dirname(__file__), "libmorse.so")


_lib = None


def _load():
    global _lib
    if _lib is not None:
        return _lib
    path = library_path()
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise MorseError(f"FAILED_PRECONDITION: cannot load {path} ({e}); build Morse "
                         "(deploy/build.sh) or unpack its bundle (deploy/bundle.sh)") from None
    P, I, U32, U64, I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int64
    S, FP = ctypes.c_char_p, ctypes.POINTER(ctypes.c_float)
    sigs = {
        "morse_capi_version": ([], I),
        "morse_last_error": ([], S),
        "morse_cuda_device": ([S, U64], I),
        "morse_session_create": ([S, S, U32, S, P, U64, S, ctypes.POINTER(P)], I),
        "morse_session_destroy": ([P], None),
        "morse_session_start": ([P, I, S, ctypes.POINTER(I64)], I),
        "morse_session_wait_all_joined": ([P], I),
        "morse_session_use_cuda": ([P, P, P], I),
        "morse_session_set_step_hyper": ([P, U32, FP, FP, FP, ctypes.POINTER(I64)], I),
        "morse_job_block_elems": ([S, S, ctypes.POINTER(U32)], I),
        "morse_session_set_buffers": ([P, P, U64], I),
        "morse_session_set_defer_apply": ([P, I], I),
        "morse_session_set_step_clipping": ([P, I], I),
        "morse_session_clip": ([P, ctypes.c_float, ctypes.POINTER(ctypes.c_double)], I),
        "morse_session_clip_pieces": ([P, ctypes.POINTER(ctypes.c_uint64),
                                       ctypes.POINTER(ctypes.c_float), ctypes.c_uint64], I),
        "morse_session_clips_locally": ([P, ctypes.POINTER(I)], I),
        "morse_session_check_first_step": ([P, I64], I),
        "morse_session_average_norm": ([P, ctypes.c_double, ctypes.POINTER(ctypes.c_double)], I),
        "morse_session_average_gradient": ([P, ctypes.POINTER(ctypes.c_float), ctypes.c_uint64], I),
        "morse_session_clipped_average": ([P, ctypes.POINTER(ctypes.c_float), ctypes.c_uint64], I),
        "morse_session_amend": ([P, ctypes.POINTER(ctypes.c_float), ctypes.c_uint64], I),
        "morse_session_received_buffers": ([P, P, U64, ctypes.POINTER(U64)], I),
        "morse_session_begin": ([P, P, U64], I),
        "morse_session_begin_device": ([P], I),
        "morse_session_send_partitions": ([P, ctypes.POINTER(U32), U32, P], I),
        "morse_session_finish": ([P, ctypes.POINTER(_Traffic)], I),
        "morse_session_partitions": ([P, ctypes.POINTER(U64), U64, ctypes.POINTER(U64)], I),
        "morse_session_idle": ([P, ctypes.c_int64, ctypes.c_uint32, ctypes.POINTER(I)], I),
        "morse_session_merge_outer": ([P, I64, P, U64], I),
        "morse_session_inner_steps_before": ([P, I64, ctypes.POINTER(I64)], I),
        "morse_session_step": ([P], I64),
        "morse_session_exchanged_step": ([P], I64),
        "morse_session_checksum": ([P, ctypes.POINTER(U64)], I),
        "morse_session_grad_sum_of_squares": ([P, ctypes.POINTER(ctypes.c_double), ctypes.POINTER(I)], I),
        "morse_session_get_state": ([P, ctypes.POINTER(I64), P, P, P], I),
        "morse_session_set_state": ([P, I64, P, P, P, P], I),
        "morse_session_state_arrays": ([P, ctypes.POINTER(U32), ctypes.POINTER(U64)], I),
        "morse_session_state_array": ([P, U32, ctypes.POINTER(S), ctypes.POINTER(U64), ctypes.POINTER(I)], I),
        "morse_session_get_own_state": ([P, P, U32, P, ctypes.POINTER(U64)], I),
        "morse_session_set_own_state": ([P, I64, P, P, P, P, P, U32, P, U64], I),
        "morse_session_interval_arrays": ([P, ctypes.POINTER(U32)], I),
        "morse_session_interval_array": ([P, U32, ctypes.POINTER(S), ctypes.POINTER(U64), ctypes.POINTER(I)], I),
        "morse_session_get_interval": ([P, P, U32, ctypes.POINTER(I64), P, P], I),
        "morse_session_set_interval": ([P, I64, P, P, P, P, P, P, U32, I64], I),
        "morse_session_server_error": ([P, P], I),
        "morse_session_reload_model": ([P], I),
        "morse_session_holds_shards_model": ([P, ctypes.POINTER(I)], I),
        "morse_session_save_checkpoint": ([P, S], I),
        "morse_session_checkpoint_every": ([P, ctypes.POINTER(U32)], I),
        "morse_session_members": ([P, ctypes.POINTER(U32), U32, ctypes.POINTER(U32)], I),
        "morse_simulator_create": ([S, S, P, U64, ctypes.POINTER(P)], I),
        "morse_simulator_destroy": ([P], None),
        "morse_simulator_step": ([P, ctypes.POINTER(P), U32, U64], I),
        "morse_simulator_step_without": ([P, ctypes.POINTER(P), U32, U64, ctypes.POINTER(U32), U32],
                                         I),
        "morse_simulator_step_hyper": ([P, ctypes.POINTER(P), U32, U64, ctypes.POINTER(U32), U32,
                                        FP, FP, U32, FP, ctypes.POINTER(I64)], I),
        "morse_simulator_checksum": ([P, ctypes.POINTER(U64)], I),
        "morse_simulator_x": ([P, FP, U64], I),
        "morse_simulator_replace_x": ([P, P, U64], I),
        "morse_simulator_replace_worker_x": ([P, U32, P, U64], I),
        "morse_simulator_worker_checksum": ([P, ctypes.c_uint32, ctypes.POINTER(U64)], I),
        "morse_link_listen": ([S, S, ctypes.POINTER(P)], I),
        "morse_link_connect": ([S, S, ctypes.c_double, ctypes.POINTER(P)], I),
        "morse_link_address": ([P, S, U64], I),
        "morse_link_accept": ([P, ctypes.c_double], I),
        "morse_link_send": ([P, U32, S, P, U64, P, U64, S], I),
        "morse_link_receive": ([P, ctypes.c_double, ctypes.POINTER(U32)] + [ctypes.POINTER(U64)] * 4, I),
        "morse_link_frame": ([P, P, P, P, P], I),
        "morse_link_traffic": ([P, ctypes.POINTER(U64), ctypes.POINTER(U64)], I),
        "morse_link_destroy": ([P], None),
        "morse_boundary_create": ([S, ctypes.POINTER(P)], I),
        "morse_boundary_destroy": ([P], None),
        "morse_boundary_encode": ([P, P, U64, U64, P, U32, I, ctypes.POINTER(U64)], I),
        "morse_boundary_payload": ([P, P, U64], I),
        "morse_boundary_decode": ([P, P, U64, U64, P, I, P, U64], I),
        "morse_boundary_save": ([P, P, U64, ctypes.POINTER(U64)], I),
        "morse_boundary_load": ([P, P, U64], I),
        "morse_boundary_samples_seen": ([P, ctypes.POINTER(U64)], I),
    }
    lib.morse_capi_version.argtypes, lib.morse_capi_version.restype = [], I
    if lib.morse_capi_version() != _CAPI_VERSION:  # before a newer function is missing
        raise MorseError(f"FAILED_PRECONDITION: {path} has C ABI version {lib.morse_capi_version()}, "
                         f"this package needs {_CAPI_VERSION}")
    for name, (args, result) in sigs.items():
        f = getattr(lib, name)
        f.argtypes, f.restype = args, result
    _lib = lib
    return lib


def _check(code):
    if code != 0:
        message = _lib.morse_last_error().decode("utf-8", "replace")
        if not message:
            message = f"{_CODES[code] if code < len(_CODES) else code}: (no message)"
        raise MorseError(message)


def _float32_array(array, what, writable=False):
    """The address of a C-contiguous float32 numpy array."""
    import numpy as np
    if not isinstance(array, np.ndarray) or array.dtype != np.float32:
        raise TypeError(f"{what} must be a float32 numpy array")
    if not array.flags["C_CONTIGUOUS"]:
        raise ValueError(f"{what} must be contiguous")
    if writable and not array.flags["WRITEABLE"]:
        raise ValueError(f"{what} must be writable")
    return array.ctypes.data


def cuda_device():
    """The GPU libmorse would use ("NVIDIA H100 ... (sm_90, 79 GiB)"); raises
    MorseError (FAILED_PRECONDITION) saying why there is none."""
    lib = _load()
    buf = ctypes.create_string_buffer(256)
    _check(lib.morse_cuda_device(buf, len(buf)))
    return buf.value.decode()


_SECURITY_KEYS = ("tls_ca", "tls_cert", "tls_key", "tls_server_name", "token_file", "insecure",
                  "refresh_seconds")


def job_block_elems(base_config, overrides):
    """The block_elems of the job the config and its overrides make (as a
    Session would read them): where parameter groups trained apart start."""
    out = ctypes.c_uint32()
    _check(_load().morse_job_block_elems(base_config.encode(), overrides.encode(),
                                         ctypes.byref(out)))
    return out.value


def _security_text(security):
    lines = []
    for key, value in security.items():
        if key not in _SECURITY_KEYS:
            raise ValueError(f"unknown security option '{key}' (known: {', '.join(_SECURITY_KEYS)})")
        if isinstance(value, bool):
            value = "1" if value else "0"
        lines.append(f"{key}={value}")
    return "\n".join(lines).encode()


class Session:
    """One worker's membership in a job (worker/session.h). `x` is a float32
    numpy array the session reads and writes in place (kept alive here)."""

    def __init__(self, base_config, overrides, rank, servers, x, security):
        lib = _load()
        self._x = x
        self._dim = x.size
        self._grad = None
        self._state_arrays, self._commit_values = None, 0  # state_arrays()
        self._interval_arrays = None  # interval_arrays()
        handle = ctypes.c_void_p()
        _check(lib.morse_session_create(base_config.encode(), overrides.encode(), rank,
                                        ",".join(servers).encode(),
                                        _float32_array(x, "parameters", writable=True), x.size,
                                        _security_text(security), ctypes.byref(handle)))
        self._handle = handle

    def __del__(self):
        if getattr(self, "_handle", None) and _lib is not None:
            _lib.morse_session_destroy(self._handle)
            self._handle = None

    def start(self, resume=False, checkpoint=""):
        step = ctypes.c_int64()
        _check(_lib.morse_session_start(self._handle, 1 if resume else 0, checkpoint.encode(),
                                        ctypes.byref(step)))
        return step.value

    def wait_all_joined(self):
        _check(_lib.morse_session_wait_all_joined(self._handle))

    def use_cuda(self, x_device_ptr, grad_device_ptr):
        _check(_lib.morse_session_use_cuda(self._handle, x_device_ptr, grad_device_ptr))

    def set_step_hyper(self, lr=None, weight_decay=None, moments=None, first_steps=None):
        """This and later steps' lr and weight decay: numbers for the whole
        model, or sequences of one per parameter group (the job's
        external.groups); None: the job's schedule. moments: None for the
        job's betas and eps, or one (beta1, beta2, eps) per lr value (every
        optimizer but diloco). first_steps: None (every group trains since
        step 0), or one step per lr value from which that group's
        parameters train (a group added mid-job; adam and onebit_adam)."""
        if lr is None:
            _check(_lib.morse_session_set_step_hyper(self._handle, 0, None, None, None, None))
            return
        lrs = list(lr) if isinstance(lr, (list, tuple)) else [lr]
        decays = list(weight_decay) if isinstance(weight_decay, (list, tuple)) else [weight_decay]
        if len(lrs) != len(decays):
            raise ValueError(f"{len(lrs)} lr values but {len(decays)} weight_decay values")
        count = len(lrs)
        if moments is not None and len(moments) != count:
            raise ValueError(f"{len(moments)} (beta1, beta2, eps) for {count} lr values")
        rule = None if moments is None else (ctypes.c_float * (3 * count))(
            *(float(v) for triple in moments for v in triple))
        if first_steps is not None and len(first_steps) != count:
            raise ValueError(f"{len(first_steps)} first steps for {count} lr values")
        firsts = None if first_steps is None else (ctypes.c_int64 * count)(*map(int, first_steps))
        _check(_lib.morse_session_set_step_hyper(self._handle, count, (ctypes.c_float * count)(*lrs),
                                                 (ctypes.c_float * count)(*decays), rule, firsts))

    def set_buffers(self, data):
        """Rank 0: module buffers (bytes) sent with the next step."""
        _check(_lib.morse_session_set_buffers(self._handle, data, len(data)))

    def set_defer_apply(self, defer):
        """Apply replies when the step finishes (True) or as they arrive."""
        _check(_lib.morse_session_set_defer_apply(self._handle, 1 if defer else 0))

    def set_step_clipping(self, on):
        """The steps that begin from now on are clipped by clip(max_norm)
        before finish, or not at all."""
        _check(_lib.morse_session_set_step_clipping(self._handle, 1 if on else 0))

    def clip(self, max_norm):
        """Clips the step in flight; returns the sum of squares it clips by
        (the averaged gradient's, waiting for every reply; in a compressing
        step this worker's own)."""
        value = ctypes.c_double()
        _check(_lib.morse_session_clip(self._handle, max_norm, ctypes.byref(value)))
        return value.value

    def clip_pieces(self, pieces):
        """Clips parts of the averaged gradient after clip() waited for every
        reply: `pieces` is [(end, scale), ...] in element order, the last
        ending at the model's size; each scales the elements since the
        previous end."""
        n = len(pieces)
        ends = (ctypes.c_uint64 * n)(*[int(e) for e, _ in pieces])
        scales = (ctypes.c_float * n)(*[float(s) for _, s in pieces])
        _check(_lib.morse_session_clip_pieces(self._handle, ends, scales, n))

    def clips_locally(self):
        """Whether the step in flight clips this worker's own gradient (a
        compressing step) rather than the averaged one."""
        value = ctypes.c_int()
        _check(_lib.morse_session_clips_locally(self._handle, ctypes.byref(value)))
        return bool(value.value)

    def first_step_refusal(self, first_step):
        """None when this job's optimizer can train a parameter group from
        step `first_step` (added mid-job), else why not."""
        try:
            _check(_lib.morse_session_check_first_step(self._handle, int(first_step)))
        except MorseError as e:
            return str(e).split(": ", 1)[-1]
        return None

    def average_norm(self, norm_type):
        """The averaged gradient's norm of order norm_type (1, 2 or inf),
        after clip() waited for every reply in a step that averages."""
        value = ctypes.c_double()
        _check(_lib.morse_session_average_norm(self._handle, float(norm_type),
                                               ctypes.byref(value)))
        return value.value

    def average_gradient(self, out):
        """Writes the averaged gradient (the replies' decoded values) into
        `out` (a contiguous float32 CPU tensor of dim elements), under
        average_norm's conditions."""
        _check(_lib.morse_session_average_gradient(
            self._handle, ctypes.cast(out.data_ptr(), ctypes.POINTER(ctypes.c_float)),
            out.numel()))

    def clipped_average(self, out):
        """Writes the step's gradient as every replica will apply it (the
        average scaled by the step's clip) into `out` (a contiguous float32
        CPU tensor of dim elements), under average_norm's conditions."""
        _check(_lib.morse_session_clipped_average(
            self._handle, ctypes.cast(out.data_ptr(), ctypes.POINTER(ctypes.c_float)),
            out.numel()))

    def amend(self, gradient):
        """Makes `gradient` (a contiguous float32 CPU tensor of dim
        elements) the step's gradient in place of its clipped average, under
        average_norm's conditions: every replica and mirror applies it."""
        _check(_lib.morse_session_amend(
            self._handle, ctypes.cast(gradient.data_ptr(), ctypes.POINTER(ctypes.c_float)),
            gradient.numel()))

    def received_buffers(self):
        """The module buffers (bytes) that came with the last step's reply."""
        size = ctypes.c_uint64()
        _check(_lib.morse_session_received_buffers(self._handle, None, 0, ctypes.byref(size)))
        out = ctypes.create_string_buffer(size.value)
        _check(_lib.morse_session_received_buffers(self._handle, out, size.value, ctypes.byref(size)))
        return out.raw[:size.value]

    def begin(self, grad):
        self._grad = grad  # kept alive until finish
        _check(_lib.morse_session_begin(self._handle, _float32_array(grad, "gradient"), grad.size))

    def begin_device(self):
        _check(_lib.morse_session_begin_device(self._handle))

    def send_partitions(self, partitions, stream=None):
        """The partitions in order, in one call (stream: a CUDA stream
        handle whose queued work the encodes wait for, or None)."""
        ids = (ctypes.c_uint32 * len(partitions))(*partitions)
        _check(_lib.morse_session_send_partitions(self._handle, ids, len(partitions), stream))

    def finish(self):
        traffic = _Traffic()
        try:
            _check(_lib.morse_session_finish(self._handle, ctypes.byref(traffic)))
        finally:
            self._grad = None
        return {"bytes_up": traffic.bytes_up, "bytes_down": traffic.bytes_down,
                "encode_seconds": traffic.encode_seconds, "apply_seconds": traffic.apply_seconds,
                "retries": traffic.retries}

    def step(self, grad):
        self.begin(grad)
        return self.finish()

    def partitions(self):
        count = ctypes.c_uint64()
        _check(_lib.morse_session_partitions(self._handle, None, 0, ctypes.byref(count)))
        ranges = (ctypes.c_uint64 * (2 * count.value))()
        _check(_lib.morse_session_partitions(self._handle, ranges, count.value, ctypes.byref(count)))
        return [(ranges[2 * i], ranges[2 * i + 1]) for i in range(count.value)]

    def idle(self, step, partition):
        """Whether `partition` sits `step` out (streaming diloco's fragments
        not due)."""
        idle = ctypes.c_int()
        _check(_lib.morse_session_idle(self._handle, step, partition, ctypes.byref(idle)))
        return bool(idle.value)

    def merge_outer(self, step, local):
        """diloco: merges the outer parameters after `step` into `local` (a
        float32 numpy array of the model's size, this rank's parameters)
        by the job's rule (compress::MergeOuter: the partitions `step`
        synced become the outer ones, or a mix by diloco.mixing)."""
        _check(_lib.morse_session_merge_outer(
            self._handle, step, _float32_array(local, "local", writable=True), local.size))

    def inner_steps_before(self, step):
        """diloco: the inner steps a worker takes before outer step `step`
        begins (compress::InnerStepsBefore: the job's warmup, then
        sync_every / fragments each)."""
        inner = ctypes.c_int64()
        _check(_lib.morse_session_inner_steps_before(self._handle, step, ctypes.byref(inner)))
        return inner.value

    @property
    def step_index(self):
        return _lib.morse_session_step(self._handle)

    @property
    def exchanged_step(self):
        """step_index, but inside a zero_one_adam local interval the step
        after its last sync (where the shards are)."""
        return _lib.morse_session_exchanged_step(self._handle)

    def grad_sum_of_squares(self):
        """The last step's averaged gradient's sum of squares, if it clipped
        that gradient; else None."""
        value, present = ctypes.c_double(), ctypes.c_int()
        _check(_lib.morse_session_grad_sum_of_squares(self._handle, ctypes.byref(value),
                                                       ctypes.byref(present)))
        return value.value if present.value else None

    def checksum(self):
        value = ctypes.c_uint64()
        _check(_lib.morse_session_checksum(self._handle, ctypes.byref(value)))
        return f"{value.value:016x}"

    def get_state(self):
        import numpy as np
        m, v, error = (np.empty(self._dim, dtype=np.float32) for _ in range(3))
        step = ctypes.c_int64()
        _check(_lib.morse_session_get_state(self._handle, ctypes.byref(step), m.ctypes.data,
                                            v.ctypes.data, error.ctypes.data))
        return step.value, m, v, error

    def set_state(self, step, m, v, error, server_error=None):
        for name, a in (("m", m), ("v", v), ("error", error), ("server_error", server_error)):
            if a is not None and a.size != self._dim:
                raise ValueError(f"{name} must hold {self._dim} values")
        _check(_lib.morse_session_set_state(
            self._handle, step, _float32_array(m, "m"), _float32_array(v, "v"),
            _float32_array(error, "error"),
            None if server_error is None else _float32_array(server_error, "server_error")))

    def state_arrays(self):
        """The optimizer's own arrays beyond m and v, in order: (name, values,
        per_element) each (OneBitLamb: v_fresh, lamb_layers; the others: none).
        Fixed for the session, so asked once."""
        if self._state_arrays is None:
            count, commit_values = ctypes.c_uint32(), ctypes.c_uint64()
            _check(_lib.morse_session_state_arrays(self._handle, ctypes.byref(count),
                                                   ctypes.byref(commit_values)))
            arrays = []
            for i in range(count.value):
                name, values, per_element = ctypes.c_char_p(), ctypes.c_uint64(), ctypes.c_int()
                _check(_lib.morse_session_state_array(self._handle, i, ctypes.byref(name),
                                                      ctypes.byref(values), ctypes.byref(per_element)))
                arrays.append((name.value.decode(), values.value, bool(per_element.value)))
            self._state_arrays, self._commit_values = arrays, commit_values.value
        return self._state_arrays

    def get_own_state(self):
        """The optimizer's own arrays ({name: float32 array}, in order) and the
        last step's commit (float64; empty before the first step and for
        optimizers without one), between steps, in one pass over the state."""
        import numpy as np
        expected = self.state_arrays()
        arrays = {name: np.empty(values, dtype=np.float32) for name, values, _ in expected}
        pointers = (ctypes.c_void_p * max(1, len(expected)))(
            *[arrays[name].ctypes.data for name, _, _ in expected])
        commit = np.empty(self._commit_values, dtype=np.float64)
        commit_values = ctypes.c_uint64()
        _check(_lib.morse_session_get_own_state(
            self._handle, pointers if expected else None, len(expected),
            commit.ctypes.data if commit.size else None, ctypes.byref(commit_values)))
        return arrays, commit[:commit_values.value]

    def set_own_state(self, step, m, v, error, server_error, arrays, commit):
        """set_state with the optimizer's own arrays (a list in state_arrays'
        order) and its last commit."""
        import numpy as np
        for name, a in (("m", m), ("v", v), ("error", error), ("server_error", server_error)):
            if a is not None and a.size != self._dim:
                raise ValueError(f"{name} must hold {self._dim} values")
        expected = self.state_arrays()
        if len(arrays) != len(expected):
            raise ValueError(f"{len(arrays)} state arrays given, the optimizer keeps {len(expected)}")
        for (name, values, _), a in zip(expected, arrays):
            if a.size != values:
                raise ValueError(f"{name} must hold {values} values")
        pointers = (ctypes.c_void_p * max(1, len(arrays)))(
            *[_float32_array(a, name) for (name, _, _), a in zip(expected, arrays)])
        commit = np.ascontiguousarray(commit, dtype=np.float64)
        _check(_lib.morse_session_set_own_state(
            self._handle, step, _float32_array(m, "m"), _float32_array(v, "v"),
            _float32_array(error, "error"),
            None if server_error is None else _float32_array(server_error, "server_error"),
            pointers if arrays else None, len(arrays),
            commit.ctypes.data if commit.size else None, commit.size))

    def interval_arrays(self):
        """zero_one_adam's local interval arrays, in order: (name, values,
        per_element) each ("anchor", "u" and "lr_sum"; the other
        optimizers: none). Fixed for the session, so asked once."""
        if self._interval_arrays is None:
            count = ctypes.c_uint32()
            _check(_lib.morse_session_interval_arrays(self._handle, ctypes.byref(count)))
            arrays = []
            for i in range(count.value):
                name, values, per_element = ctypes.c_char_p(), ctypes.c_uint64(), ctypes.c_int()
                _check(_lib.morse_session_interval_array(
                    self._handle, i, ctypes.byref(name), ctypes.byref(values),
                    ctypes.byref(per_element)))
                arrays.append((name.value.decode(), values.value, bool(per_element.value)))
            self._interval_arrays = arrays
        return self._interval_arrays

    def get_interval(self, with_shards):
        """Between steps inside a local interval: its arrays ({name: float32
        array}, in order), its last local step, and with_shards (rank 0) the
        shards' m and error buffers at its last sync (else None, None)."""
        import numpy as np
        expected = self.interval_arrays()
        arrays = {name: np.empty(values, dtype=np.float32) for name, values, _ in expected}
        pointers = (ctypes.c_void_p * max(1, len(expected)))(
            *[arrays[name].ctypes.data for name, _, _ in expected])
        shards_m, server_error = ((np.empty(self._dim, dtype=np.float32) for _ in range(2))
                                  if with_shards else (None, None))
        last = ctypes.c_int64()
        _check(_lib.morse_session_get_interval(
            self._handle, pointers, len(expected), ctypes.byref(last),
            None if shards_m is None else shards_m.ctypes.data,
            None if server_error is None else server_error.ctypes.data))
        return arrays, last.value, shards_m, server_error

    def set_interval(self, step, m, v, error, server_error, shards_m, arrays, last_local_step):
        """set_state for a state saved inside a local interval: `arrays` in
        interval_arrays' order; server_error and shards_m rank 0's (or
        None)."""
        for name, a in (("m", m), ("v", v), ("error", error), ("server_error", server_error),
                        ("shards_m", shards_m)):
            if a is not None and a.size != self._dim:
                raise ValueError(f"{name} must hold {self._dim} values")
        expected = self.interval_arrays()
        if len(arrays) != len(expected):
            raise ValueError(f"{len(arrays)} interval arrays given, the optimizer keeps "
                             f"{len(expected)}")
        for (name, values, _), a in zip(expected, arrays):
            if a.size != values:
                raise ValueError(f"{name} must hold {values} values")
        pointers = (ctypes.c_void_p * max(1, len(arrays)))(
            *[_float32_array(a, name) for (name, _, _), a in zip(expected, arrays)])
        _check(_lib.morse_session_set_interval(
            self._handle, step, _float32_array(m, "m"), _float32_array(v, "v"),
            _float32_array(error, "error"),
            None if server_error is None else _float32_array(server_error, "server_error"),
            None if shards_m is None else _float32_array(shards_m, "shards_m"),
            pointers, len(arrays), last_local_step))

    def server_error(self):
        import numpy as np
        out = np.empty(self._dim, dtype=np.float32)
        _check(_lib.morse_session_server_error(self._handle, out.ctypes.data))
        return out

    def reload_model(self):
        """Between steps: the parameters as changed since start, or since
        the last step, become the job's (rank 0 gives them to the shards;
        the others wait until the shards hold their values)."""
        _check(_lib.morse_session_reload_model(self._handle))

    def holds_shards_model(self):
        """Whether the shards hold these parameters at this worker's step
        (downloads the shards' model)."""
        holds = ctypes.c_int()
        _check(_lib.morse_session_holds_shards_model(self._handle, ctypes.byref(holds)))
        return bool(holds.value)

    def save_checkpoint(self, path):
        _check(_lib.morse_session_save_checkpoint(self._handle, path.encode()))

    def members(self):
        """The ranks in every partition's average of the last step."""
        count = ctypes.c_uint32()
        _check(_lib.morse_session_members(self._handle, None, 0, ctypes.byref(count)))
        ranks = (ctypes.c_uint32 * max(count.value, 1))()
        _check(_lib.morse_session_members(self._handle, ranks, count.value, ctypes.byref(count)))
        return list(ranks[:count.value])

    def checkpoint_every(self):
        """The job's checkpoint.every_steps (0: none)."""
        every = ctypes.c_uint32()
        _check(_lib.morse_session_checkpoint_every(self._handle, ctypes.byref(every)))
        return every.value


class Simulator:
    """The single-process simulator (compress/simulator.h): the oracle the
    tests compare jobs with."""

    def __init__(self, base_config, overrides, x0):
        lib = _load()
        self._dim = x0.size
        handle = ctypes.c_void_p()
        _check(lib.morse_simulator_create(base_config.encode(), overrides.encode(),
                                          _float32_array(x0, "x0"), x0.size, ctypes.byref(handle)))
        self._handle = handle

    def __del__(self):
        if getattr(self, "_handle", None) and _lib is not None:
            _lib.morse_simulator_destroy(self._handle)
            self._handle = None

    def step(self, gradients, absent=(), hypers=(), first_steps=None):
        """One step; `absent`: ranks every partition's average leaves out;
        `hypers`: the step's (lr, weight_decay) as the workers set them, one
        for the model or one per parameter group (none: the job's
        schedule), each with beta1, beta2 and eps after them where the
        workers set those too (all or none); `first_steps`: None, or one
        step per hyper from which that group's parameters train."""
        for g in gradients:
            if g.size != self._dim:
                raise ValueError(f"each gradient must hold {self._dim} values")
        pointers = (ctypes.c_void_p * len(gradients))(
            *(_float32_array(g, "gradient") for g in gradients))
        out = (ctypes.c_uint32 * max(len(absent), 1))(*sorted(absent))
        count = len(hypers)
        lrs = (ctypes.c_float * max(count, 1))(*(float(h[0]) for h in hypers))
        decays = (ctypes.c_float * max(count, 1))(*(float(h[1]) for h in hypers))
        if len({len(h) for h in hypers}) > 1 or any(len(h) not in (2, 5) for h in hypers):
            raise ValueError("each hyper is (lr, weight_decay) or (lr, weight_decay, beta1, beta2, "
                             "eps), all alike")
        moments = (None if not hypers or len(hypers[0]) == 2
                   else (ctypes.c_float * (3 * count))(*(float(v) for h in hypers for v in h[2:])))
        if first_steps is not None and len(first_steps) != count:
            raise ValueError(f"{len(first_steps)} first steps for {count} hypers")
        firsts = (None if first_steps is None
                  else (ctypes.c_int64 * max(count, 1))(*map(int, first_steps)))
        _check(_lib.morse_simulator_step_hyper(self._handle, pointers, len(gradients), self._dim,
                                               out, len(absent), lrs, decays, count, moments,
                                               firsts))

    def checksum(self):
        value = ctypes.c_uint64()
        _check(_lib.morse_simulator_checksum(self._handle, ctypes.byref(value)))
        return f"{value.value:016x}"

    def worker_checksum(self, rank):
        """Worker `rank`'s own state (zero_one_adam's local steps move each
        worker on its own; elsewhere it is checksum())."""
        value = ctypes.c_uint64()
        _check(_lib.morse_simulator_worker_checksum(self._handle, rank, ctypes.byref(value)))
        return f"{value.value:016x}"

    def x(self):
        import numpy as np
        out = np.empty(self._dim, dtype=np.float32)
        _check(_lib.morse_simulator_x(self._handle, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                      self._dim))
        return out

    def replace_x(self, x):
        """Weights changed between steps: every replica's x becomes `x`."""
        _check(_lib.morse_simulator_replace_x(self._handle, _float32_array(x, "x"), x.size))

    def replace_worker_x(self, rank, x):
        """Inside a zero_one_adam local interval: worker `rank`'s own x
        becomes `x`."""
        _check(_lib.morse_simulator_replace_worker_x(self._handle, rank,
                                                     _float32_array(x, "x"), x.size))


class Link:
    """One end of a pipeline boundary (worker/stage_link.h): listen() for
    the later stage, connect() for the earlier one. Frames are
    (kind, meta str, payload bytes, extra bytes, error str)."""

    HELLO, FORWARD, BACKWARD, ERROR, END = range(5)

    def __init__(self, handle):
        self._handle = handle

    @classmethod
    def listen(cls, address, security):
        lib = _load()
        handle = ctypes.c_void_p()
        _check(lib.morse_link_listen(address.encode(), _security_text(security), ctypes.byref(handle)))
        return cls(handle)

    @classmethod
    def connect(cls, address, security, timeout):
        lib = _load()
        handle = ctypes.c_void_p()
        _check(lib.morse_link_connect(address.encode(), _security_text(security), float(timeout),
                                      ctypes.byref(handle)))
        return cls(handle)

    @property
    def address(self):
        buf = ctypes.create_string_buffer(256)
        _check(_lib.morse_link_address(self._handle, buf, len(buf)))
        return buf.value.decode()

    def accept(self, timeout):
        _check(_lib.morse_link_accept(self._handle, float(timeout)))

    def send(self, kind, meta="", payload=b"", extra=b"", error=""):
        _check(_lib.morse_link_send(self._handle, kind, meta.encode(), payload, len(payload), extra,
                                    len(extra), error.encode()))

    def receive(self, timeout):
        kind = ctypes.c_uint32()
        sizes = [ctypes.c_uint64() for _ in range(4)]
        _check(_lib.morse_link_receive(self._handle, float(timeout), ctypes.byref(kind),
                                       *(ctypes.byref(n) for n in sizes)))
        parts = [ctypes.create_string_buffer(max(1, n.value)) for n in sizes]
        _check(_lib.morse_link_frame(self._handle, *parts))
        meta, payload, extra, error = (p.raw[:n.value] for p, n in zip(parts, sizes))
        return kind.value, meta.decode(), payload, extra, error.decode("utf-8", "replace")

    def traffic(self):
        sent, received = ctypes.c_uint64(), ctypes.c_uint64()
        _check(_lib.morse_link_traffic(self._handle, ctypes.byref(sent), ctypes.byref(received)))
        return sent.value, received.value

    def close(self):
        if getattr(self, "_handle", None) and _lib is not None:
            _lib.morse_link_destroy(self._handle)
            self._handle = None

    def __del__(self):
        self.close()


class Boundary:
    """One direction of a boundary's codec and feedback state
    (compress/boundary.h). mode: 0 training, 1 inference with the codec,
    2 inference in fp32."""

    def __init__(self, spec):
        lib = _load()
        handle = ctypes.c_void_p()
        _check(lib.morse_boundary_create(spec.encode(), ctypes.byref(handle)))
        self._handle = handle
        self.spec = spec

    def __del__(self):
        if getattr(self, "_handle", None) and _lib is not None:
            _lib.morse_boundary_destroy(self._handle)
            self._handle = None

    @staticmethod
    def _samples(samples, rows):
        import numpy as np
        if samples is None:
            return None, None
        s = np.ascontiguousarray(samples, dtype=np.int64)
        if s.size != rows:
            raise ValueError(f"{s.size} sample indices for {rows} rows")
        return s, s.ctypes.data

    def encode(self, x, rows, samples=None, slot=0, mode=0):
        """x: a C-contiguous float32 numpy array; returns the payload bytes."""
        keep, pointer = self._samples(samples, rows)
        size = ctypes.c_uint64()
        _check(_lib.morse_boundary_encode(self._handle, _float32_array(x, "the boundary tensor"), x.size,
                                          rows, pointer, slot, mode, ctypes.byref(size)))
        out = ctypes.create_string_buffer(max(1, size.value))
        _check(_lib.morse_boundary_payload(self._handle, out, size.value))
        del keep
        return out.raw[:size.value]

    def decode(self, payload, out, rows, samples=None, mode=0):
        """Decodes into out (a float32 numpy array of the tensor's size)."""
        keep, pointer = self._samples(samples, rows)
        _check(_lib.morse_boundary_decode(self._handle, payload, len(payload), rows, pointer, mode,
                                          _float32_array(out, "out", writable=True), out.size))
        del keep
        return out

    def state(self):
        size = ctypes.c_uint64()
        _check(_lib.morse_boundary_save(self._handle, None, 0, ctypes.byref(size)))
        out = ctypes.create_string_buffer(max(1, size.value))
        _check(_lib.morse_boundary_save(self._handle, out, size.value, ctypes.byref(size)))
        return out.raw[:size.value]

    def load(self, state):
        _check(_lib.morse_boundary_load(self._handle, state, len(state)))

    def samples_seen(self):
        count = ctypes.c_uint64()
        _check(_lib.morse_boundary_samples_seen(self._handle, ctypes.byref(count)))
        return count.value
