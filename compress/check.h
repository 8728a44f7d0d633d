// MORSE_CHECK: a broken invariant (a caller bug, never bad input) aborts
// loudly with the file, line and condition, in every build type.
#ifndef MORSE_COMPRESS_CHECK_H_
#define MORSE_COMPRESS_CHECK_H_

#include <cstdio>
#include <cstdlib>

#define MORSE_CHECK(cond)                                               \
  do {                                                                  \
    if (!(cond)) {                                                      \
      std::fprintf(stderr, "%s:%d: MORSE_CHECK failed: %s\n", __FILE__, \
                   __LINE__, #cond);                                    \
      std::abort();                                                     \
    }                                                                   \
  } while (0)

#endif  // MORSE_COMPRESS_CHECK_H_
