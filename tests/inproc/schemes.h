// The optimizer and codec schemes the in-process sweeps run (fault_sweep_test,
// membership_test), over the synthetic workload with D = 5003: 20 blocks of
// 256, 1024-element partitions (five, the last short).
#ifndef MORSE_TESTS_INPROC_SCHEMES_H_
#define MORSE_TESTS_INPROC_SCHEMES_H_

namespace morse::inproc {

struct Scheme {
  const char* name;
  const char* config;  // JobConfig fields, text format
};

inline constexpr Scheme kSchemes[] = {
    {"onebit_adam_sign1", R"(optimizer: "onebit_adam" freeze_step: 3)"},
    {"adam_int4",
     R"(optimizer: "adam" up_codec { codec: "int4" } down_codec { codec: "int8" })"},
    {"zero_one_adam", R"(optimizer: "zero_one_adam"
       zero_one_adam { var_freeze_step: 4 var_update_scaler: 2 local_step_scaler: 4 local_step_clipper: 2 })"},
    // Rank 0 commits every step's layer coefficients (Commit; every rank in
    // an elastic job, where rank 0 may be the one missing). Clipped: the
    // warmup's commits carry the averaged gradient's norm with them (the
    // norm is far above 0.5).
    {"onebit_lamb",
     R"(optimizer: "onebit_lamb" freeze_step: 3 clip_grad_norm: 0.5)"},
};

}  // namespace morse::inproc

#endif  // MORSE_TESTS_INPROC_SCHEMES_H_
