/* libmorse: the worker library (worker/session.h) and the simulator behind a
 * plain C ABI, for the `morse` Python package (loaded through ctypes, so one
 * build serves every Python 3 and every PyTorch) and for anything else that
 * can call C.
 *
 * Every function that can fail returns 0 or an absl/gRPC canonical status
 * code (3 = INVALID_ARGUMENT, 9 = FAILED_PRECONDITION, ...); the message of
 * the calling thread's last failure, "CODE_NAME: what happened", is
 * morse_last_error(). Arrays are raw pointers to float32 memory that the
 * caller owns and keeps alive: host memory, or device memory for the
 * functions that say so. Functions may block (network) and never call
 * back into the caller. */
#ifndef MORSE_WORKER_PYTHON_CAPI_H_
#define MORSE_WORKER_PYTHON_CAPI_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MORSE_CAPI_VERSION 20

typedef struct morse_session morse_session;
typedef struct morse_simulator morse_simulator;
typedef struct morse_link morse_link;
typedef struct morse_boundary morse_boundary;

typedef struct morse_step_traffic {
  uint64_t bytes_up;
  uint64_t bytes_down;
  double encode_seconds;
  double apply_seconds;
  uint64_t retries;
} morse_step_traffic;

int morse_capi_version(void);
const char* morse_last_error(void);

/* The GPU this process would use, "NVIDIA H100 ... (sm_90, 79 GiB)", into
 * buf (NUL-terminated, truncated to size). FAILED_PRECONDITION with the
 * reason when there is none or the library was built without CUDA. */
int morse_cuda_device(char* buf, uint64_t size);

/* The block_elems of the job that base and overrides (as for
 * morse_session_create) make, into *out: where parameter groups trained
 * apart must start (their sizes padded to whole blocks; external.groups).
 * INVALID_ARGUMENT as morse_session_create for a bad config. */
int morse_job_block_elems(const char* base, const char* overrides,
                          uint32_t* out);

/* Joins a job. base: a JobConfig in text format (may be empty); overrides:
 * more fields, applied after it; servers: "host:port,host:port"; x: dim host
 * floats holding the parameters (the session reads and writes them);
 * security: "key=value" lines with the worker's flag names (tls_ca,
 * tls_cert, tls_key, tls_server_name, token_file, insecure=1,
 * refresh_seconds=N). */
int morse_session_create(const char* base, const char* overrides, uint32_t rank,
                         const char* servers, float* x, uint64_t dim,
                         const char* security, morse_session** out);
void morse_session_destroy(morse_session* s);

/* Rank 0 uploads x, the others receive it (resume = 0), or x, m, v come from
 * the shards (resume = 1; the error buffer from checkpoint if it matches).
 * *first_step: the step training continues from. */
int morse_session_start(morse_session* s, int resume, const char* checkpoint,
                        int64_t* first_step);
int morse_session_wait_all_joined(morse_session* s);

/* Moves the model to the GPU: from now on x, m, v and the error buffer live
 * there, x in the caller's device array x_device and the gradient read from
 * grad_device (dim floats each, on the current device). The host x given at
 * create is copied into x_device. Then steps use morse_session_begin_device. */
int morse_session_use_cuda(morse_session* s, float* x_device,
                           float* grad_device);

/* A step in pieces: begin (grad: dim host floats, kept alive until finish),
 * send each partition whose gradient is complete, finish (sends the rest,
 * waits for every reply, applies them). On the GPU, begin_device and
 * send_partition_on_stream: the partition's encode waits for the work
 * already queued on `stream` (a cudaStream_t; 0 is the legacy default
 * stream), so the gradient it reads is complete. */
/* The learning rates and weight decays of the steps that begin from now on
 * (PyTorch's param_groups), sent with every push and applied by every
 * replica: `count` of each, 1 for the whole model or one per parameter
 * group of the job's external.groups; count = 0: the job's schedule
 * again. `moments`: NULL for the job's betas and eps, or 3 * count floats,
 * each group's beta1, beta2 and eps for these steps in turn (every
 * optimizer but diloco: groups with their own, a scheduler that cycles the
 * momentum). `first_steps`: NULL (every group trains since step 0), or
 * count steps from which each group's parameters train (a group added
 * mid-job: its bias corrections count from there; adam and onebit_adam,
 * the latter before freeze_step). */
int morse_session_set_step_hyper(morse_session* s, uint32_t count,
                                 const float* lr, const float* weight_decay,
                                 const float* moments,
                                 const int64_t* first_steps);

/* Rank 0: `size` bytes of module buffers sent with the next step's push of
 * partition 0 (at most 64 MiB). After a step, every worker reads what came
 * back with partition 0's reply: *size is set to its length, and up to
 * `capacity` bytes are copied to `out` (pass capacity 0 to ask the size). */
int morse_session_set_buffers(morse_session* s, const void* data,
                              uint64_t size);
/* defer != 0: replies are kept and applied when the step finishes, so the
 * parameters change only then (Session::SetDeferApply). */
int morse_session_set_defer_apply(morse_session* s, int defer);
int morse_session_received_buffers(morse_session* s, void* out,
                                   uint64_t capacity, uint64_t* size);
/* on != 0: the steps that begin from now on are clipped by a max_norm the
 * caller gives after its backward pass, with morse_session_clip before
 * finish (none: not clipped) (Session::SetStepClipping; morse.torch's
 * clip_grad_norm_). FAILED_PRECONDITION in a job with clip_grad_norm. */
int morse_session_set_step_clipping(morse_session* s, int on);
/* Clips the step in flight by max_norm (0: no clip) (Session::ClipAt):
 * *sum_of_squares is what it clips by, the averaged gradient's once every
 * reply is in (again: the last max_norm counts), or in a compressing step
 * this worker's own gradient's (its pushes leave now; once). */
int morse_session_clip(morse_session* s, float max_norm,
                       double* sum_of_squares);
/* Clips parts of the averaged gradient of the step in flight, after
 * morse_session_clip waited for every reply: piece i scales elements
 * [ends[i-1] (0 for the first), ends[i]) by scales[i]; n pieces, the last
 * ending at the model's size (Session::ClipPiecesAt; clip_grad_norm_ over
 * some of the parameters). */
int morse_session_clip_pieces(morse_session* s, const uint64_t* ends,
                              const float* scales, uint64_t n);
/* *locally = 1 when the step in flight clips this worker's own gradient (a
 * compressing step), else 0 (Session::clips_locally). */
int morse_session_clips_locally(morse_session* s, int* locally);
/* OK when this job's optimizer can train a parameter group whose first step
 * is `first_step` (a group added mid-job: compress::CheckStepHyper, which
 * the shards apply to its pushes), else INVALID_ARGUMENT saying why. */
int morse_session_check_first_step(morse_session* s, int64_t first_step);
/* The averaged gradient's norm of order norm_type (1, 2 or inf) once
 * morse_session_clip has waited for every reply in a step that averages
 * (Session::AverageNorm). */
int morse_session_average_norm(morse_session* s, double norm_type,
                               double* norm);
/* The averaged gradient itself (dim floats, the replies' decoded values)
 * under the same conditions, host replies only (Session::AverageGradient):
 * for a norm of another order. */
int morse_session_average_gradient(morse_session* s, float* out, uint64_t dim);
/* The step's gradient as every replica will apply it: the average scaled
 * by the step's clip (or its amended gradient), under the same conditions
 * (Session::ClippedAverage): what DDP's .grad holds after its clip. */
int morse_session_clipped_average(morse_session* s, float* out, uint64_t dim);
/* Makes `gradient` (dim floats) the step's gradient in place of the
 * clipped average, under the same conditions (Session::AmendAt): a
 * script's edit of .grad after clip_grad_norm_. */
int morse_session_amend(morse_session* s, const float* gradient, uint64_t dim);

int morse_session_begin(morse_session* s, const float* grad, uint64_t dim);
int morse_session_begin_device(morse_session* s);
/* Pushes the `count` partitions in order (Session::SendPartition). stream:
 * in a device session, the CUDA stream whose queued work their encodes (and
 * any later work of the session on the gradient) wait for, waited for once;
 * NULL there is the legacy default stream (PyTorch's default stream). A
 * host session takes NULL only. One call for what one backward() hook
 * completes; count 0 only waits for the stream. */
int morse_session_send_partitions(morse_session* s, const uint32_t* partitions,
                                  uint32_t count, void* stream);
int morse_session_finish(morse_session* s, morse_step_traffic* traffic);

/* The partitions as [begin, end) pairs: ranges gets 2 * capacity values;
 * *count is the number of partitions (call with capacity 0 to ask). */
int morse_session_partitions(morse_session* s, uint64_t* ranges,
                             uint64_t capacity, uint64_t* count);
/* Whether partition `partition` sits step `step` out (*idle 1: streaming
 * diloco's fragments not due, compress::Idle), else *idle 0. */
int morse_session_idle(morse_session* s, int64_t step, uint32_t partition,
                       int* idle);
/* diloco: after outer step `step` (>= 0) completed (not while one is in
 * flight), merges the session's outer parameters into `local` (dim values, this
 * rank's own parameters) by compress::MergeOuter: the partitions `step`
 * synced become the outer ones, or mixing * local + (1 - mixing) * outer by
 * the job's diloco.mixing; the others are left. */
int morse_session_merge_outer(morse_session* s, int64_t step, float* local,
                              uint64_t dim);
/* diloco: the inner steps a worker takes before outer step `step` (>= 0)
 * begins, by compress::InnerStepsBefore (the job's warmup, then
 * sync_every / fragments each). */
int morse_session_inner_steps_before(morse_session* s, int64_t step,
                                     int64_t* inner_steps);
int64_t morse_session_step(morse_session* s);
/* The step after the last exchange: morse_session_step but inside a
 * zero_one_adam local interval, where it is the step after its last sync
 * (the step the shards hold the state of). */
int64_t morse_session_exchanged_step(morse_session* s);
/* The sum of squares of the last step's averaged gradient when that step
   clipped it (clip_grad_norm): *present 1 and *value; else *present 0. */
int morse_session_grad_sum_of_squares(morse_session* s, double* value,
                                      int* present);
/* FNV checksum of x, m, v (equal on every worker after every step). */
int morse_session_checksum(morse_session* s, uint64_t* checksum);
/* The optimizer state into/from dim host floats each (state_dict).
   set_state also brings the shards to the saved run (Session::Restore):
   server_error (dim floats, or NULL) is what morse_session_server_error
   gave on rank 0 when the run was saved. */
int morse_session_get_state(morse_session* s, int64_t* step, float* m, float* v,
                            float* error);
int morse_session_set_state(morse_session* s, int64_t step, const float* m,
                            const float* v, const float* error,
                            const float* server_error);
/* The optimizer's own state beyond m and v (state_dict; design.md 5, the
   optimizer seam): *count arrays; array i is named *name (valid while the
   session lives), holds *values floats and has *per_element 1 when that is
   one value per parameter (dim). onebit_lamb: "v_fresh" (v'),
   "lamb_layers" (2 per layer); the others: none. *commit_values: how many
   doubles its commit holds (onebit_lamb's layer coefficients, 3 per layer;
   0: it commits nothing). */
int morse_session_state_arrays(morse_session* s, uint32_t* count,
                               uint64_t* commit_values);
int morse_session_state_array(morse_session* s, uint32_t i, const char** name,
                              uint64_t* values, int* per_element);
/* Between steps, in one pass over the session's state: arrays[i] receives
   array i (`count` of them, in order), `commit` (room for the
   commit_values state_arrays gave) the last step's commit, and
   *commit_values how many it holds (0 before the first step). */
int morse_session_get_own_state(morse_session* s, float* const* arrays,
                                uint32_t count, double* commit,
                                uint64_t* commit_values);
/* set_state for an optimizer with state of its own (set_state refuses
   one): arrays[i] holds array i, `count` of them in order, and the last
   step's commit (commit_values doubles, or 0). */
int morse_session_set_own_state(morse_session* s, int64_t step, const float* m,
                                const float* v, const float* error,
                                const float* server_error,
                                const float* const* arrays, uint32_t count,
                                const double* commit, uint64_t commit_values);
/* zero_one_adam's local interval (design.md 2.7), whose state no other
   call holds: its arrays (compress::Optimizer::IntervalState) are listed
   as morse_session_state_array lists the optimizer's own: *count of them
   (zero_one_adam: "anchor" and "u", one value per parameter, and "lr_sum",
   one per segment; the others: none). */
int morse_session_interval_arrays(morse_session* s, uint32_t* count);
int morse_session_interval_array(morse_session* s, uint32_t i,
                                 const char** name, uint64_t* values,
                                 int* per_element);
/* Between steps inside a local interval (FAILED_PRECONDITION elsewhere):
   arrays[i] receives interval array i (`count`, in order), and
   *last_local_step the interval's last local step; with shards_m and
   server_error (dim floats each, both or neither; rank 0) also the
   shards' m and error buffers at the interval's last sync. */
int morse_session_get_interval(morse_session* s, float* const* arrays,
                               uint32_t count, int64_t* last_local_step,
                               float* shards_m, float* server_error);
/* set_state for a state saved inside a local interval (set_state refuses
   one): the worker's m, v and error at `step`, its interval arrays and
   last local step, and on rank 0 against fresh shards their server_error
   and m at the interval's last sync (shards_m; NULL elsewhere). The
   worker's x is its parameters as they are (its own, written before). */
int morse_session_set_interval(morse_session* s, int64_t step, const float* m,
                               const float* v, const float* error,
                               const float* server_error, const float* shards_m,
                               const float* const* arrays, uint32_t count,
                               int64_t last_local_step);
/* The shards' error buffers (dim floats), between steps. */
int morse_session_server_error(morse_session* s, float* out);
/* Between steps: the parameters as the caller changed them (since start,
   or since the last step) become the job's (Session::ReloadModel: rank 0
   restores the shards before the first step, replaces their x after one;
   the other ranks wait until the shards hold their x). */
int morse_session_reload_model(morse_session* s);
/* *holds = 1 when the shards hold this worker's parameters at its step
 * (Session::HoldsShardsModel: downloads the shards' model), else 0. */
int morse_session_holds_shards_model(morse_session* s, int* holds);
int morse_session_save_checkpoint(morse_session* s, const char* path);
/* The job's checkpoint.every_steps (0: the job does not checkpoint): a rank
   that may be restarted saves its checkpoint after each step whose count
   is a multiple of it. */
int morse_session_checkpoint_every(morse_session* s, uint32_t* every_steps);
/* The ranks in every partition's average of the last step (membership,
   docs/design.md 4, "Membership"; all of them before the first step and in a
   job without min_workers), ascending: *count of them, the first `capacity`
   written to `ranks`. */
int morse_session_members(morse_session* s, uint32_t* ranks, uint32_t capacity,
                          uint32_t* count);

/* The single-process simulator (compress/simulator.h): the oracle. */
int morse_simulator_create(const char* base, const char* overrides,
                           const float* x0, uint64_t dim,
                           morse_simulator** out);
void morse_simulator_destroy(morse_simulator* sim);
/* One step from `workers` gradients of dim floats each. */
int morse_simulator_step(morse_simulator* sim, const float* const* gradients,
                         uint32_t workers, uint64_t dim);
/* The same, with `count` ranks (ascending) left out of every partition's
   average (membership, docs/design.md 4, "Membership"). */
int morse_simulator_step_without(morse_simulator* sim,
                                 const float* const* gradients,
                                 uint32_t workers, uint64_t dim,
                                 const uint32_t* absent, uint32_t count);
/* The same, with the step's learning rates and weight decays as the
   workers set them (morse_session_set_step_hyper): `hypers` of each, one
   for the model or one per parameter group (0: the job's schedule), and
   `moments` NULL or their betas and eps (3 * hypers floats), `first_steps`
   NULL or the step each one's parameters train from. */
int morse_simulator_step_hyper(morse_simulator* sim,
                               const float* const* gradients, uint32_t workers,
                               uint64_t dim, const uint32_t* absent,
                               uint32_t count, const float* lr,
                               const float* weight_decay, uint32_t hypers,
                               const float* moments,
                               const int64_t* first_steps);
int morse_simulator_checksum(morse_simulator* sim, uint64_t* checksum);
/* Worker `rank`'s own x, m, v (differs from the shared state only after
   zero_one_adam's local steps). */
int morse_simulator_worker_checksum(morse_simulator* sim, uint32_t rank,
                                    uint64_t* checksum);
int morse_simulator_x(morse_simulator* sim, float* x, uint64_t dim);
/* Weights changed between steps: every replica's x becomes x (dim floats),
   the rest of the state kept (Simulator::ReplaceX). */
int morse_simulator_replace_x(morse_simulator* sim, const float* x,
                              uint64_t dim);
/* Inside a zero_one_adam local interval: worker `rank`'s own x becomes x
   (Simulator::ReplaceWorkerX). */
int morse_simulator_replace_worker_x(morse_simulator* sim, uint32_t rank,
                                     const float* x, uint64_t dim);

/* Pipeline stages (worker/stage_link.h, compress/boundary.h). */

/* The later stage's end of a boundary: listens on address ("host:port",
 * port 0 picks one) for the earlier stage; security as for a server
 * ("key=value" lines: tls_cert, tls_key, tls_ca, token_file, insecure=1).
 * The address with its real port: morse_link_address. */
int morse_link_listen(const char* address, const char* security,
                      morse_link** out);
/* The earlier stage's end: connects to address within timeout_seconds;
 * security as for a worker. */
int morse_link_connect(const char* address, const char* security,
                       double timeout_seconds, morse_link** out);
int morse_link_address(morse_link* link, char* buf, uint64_t size);
/* Listening end: waits for the earlier stage's stream. */
int morse_link_accept(morse_link* link, double timeout_seconds);
/* Sends one frame (kind: 0 hello, 1 forward, 2 backward, 3 error, 4 end);
 * meta and error are NUL-terminated, payload and extra any bytes. */
int morse_link_send(morse_link* link, uint32_t kind, const char* meta,
                    const void* payload, uint64_t payload_size,
                    const void* extra, uint64_t extra_size, const char* error);
/* Waits for the next frame and keeps it; its kind and the sizes of its
 * parts come back here, the parts through morse_link_frame (buffers of at
 * least those sizes; meta and error are not NUL-terminated).
 * UNAVAILABLE when the peer is gone, DEADLINE_EXCEEDED after the timeout. */
int morse_link_receive(morse_link* link, double timeout_seconds, uint32_t* kind,
                       uint64_t* meta_size, uint64_t* payload_size,
                       uint64_t* extra_size, uint64_t* error_size);
int morse_link_frame(morse_link* link, void* meta, void* payload, void* extra,
                     void* error);
int morse_link_traffic(morse_link* link, uint64_t* bytes_sent,
                       uint64_t* bytes_received);
/* Closes the stream and frees the link. */
void morse_link_destroy(morse_link* link);

/* One direction of a boundary: spec as compress/boundary.h's
 * ParseBoundarySpec ("fp32", "int4/128", "topk:0.1+ef", "int8+aq"). */
int morse_boundary_create(const char* spec, morse_boundary** out);
void morse_boundary_destroy(morse_boundary* b);
/* Encodes n floats (rows rows; samples: one index per row for AQ-SGD, else
 * may be NULL; slot: the micro-batch, for ef) and keeps the payload; *size
 * gets its length, morse_boundary_payload copies it out. mode 0: training
 * (feedback state used and updated), 1: inference with the codec and no
 * state, 2: inference in fp32. */
int morse_boundary_encode(morse_boundary* b, const float* x, uint64_t n,
                          uint64_t rows, const int64_t* samples, uint32_t slot,
                          int mode, uint64_t* size);
int morse_boundary_payload(morse_boundary* b, void* out, uint64_t capacity);
/* Decodes a payload of the same mode into n floats at out. */
int morse_boundary_decode(morse_boundary* b, const void* payload, uint64_t size,
                          uint64_t rows, const int64_t* samples, int mode,
                          float* out, uint64_t n);
/* The state (ef buffers, AQ-SGD buffers): *size its length; up to capacity
 * bytes copied to out (capacity 0 asks the size). */
int morse_boundary_save(morse_boundary* b, void* out, uint64_t capacity,
                        uint64_t* size);
int morse_boundary_load(morse_boundary* b, const void* state, uint64_t size);
/* AQ-SGD: how many samples have buffers. */
int morse_boundary_samples_seen(morse_boundary* b, uint64_t* count);

#ifdef __cplusplus
}
#endif

#endif /* MORSE_WORKER_PYTHON_CAPI_H_ */
