// The host engine (worker/engine/engine.h): a worker's state is the
// session's own replica and error buffer, and every operation is
// compress/'s.
#ifndef MORSE_WORKER_ENGINE_HOST_ENGINE_H_
#define MORSE_WORKER_ENGINE_HOST_ENGINE_H_

#include <memory>

#include "worker/engine/engine.h"

namespace morse::worker::host {

std::unique_ptr<Engine> CreateEngine(const EngineState& state);

}  // namespace morse::worker::host

#endif  // MORSE_WORKER_ENGINE_HOST_ENGINE_H_
