// Scalar conversions between fp32 and the 16-bit formats of DESIGN 2.3, both
// rounding to nearest even (overflow to infinity, NaN stays NaN). Exposed for
// tests and for the CUDA kernels' reference checks.
#ifndef MORSE_COMPRESS_FLOAT_CODEC_H_
#define MORSE_COMPRESS_FLOAT_CODEC_H_

#include <cstdint>

namespace morse::compress {

uint16_t FloatToHalf(float f);
float HalfToFloat(uint16_t h);
uint16_t FloatToBfloat16(float f);
float Bfloat16ToFloat(uint16_t b);

}  // namespace morse::compress

#endif  // MORSE_COMPRESS_FLOAT_CODEC_H_
