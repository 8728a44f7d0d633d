// The credential flags both daemons take (--tls_cert, --tls_key, --tls_ca,
// --tls_server_name, --token_file, --tls_refresh_seconds, --insecure); see
// proto/security.h for what each means to a server and to a worker.
#ifndef MORSE_PROTO_SECURITY_FLAGS_H_
#define MORSE_PROTO_SECURITY_FLAGS_H_

#include "proto/security.h"

namespace morse::proto {

SecurityOptions SecurityOptionsFromFlags();

}  // namespace morse::proto

#endif  // MORSE_PROTO_SECURITY_FLAGS_H_
