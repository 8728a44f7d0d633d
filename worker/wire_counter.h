// WireCounter: the TCP bytes this process sent and received over the whole
// run, across reconnects (issue 40).
//
// Linux keeps a sent (acknowledged) and a received byte count for each TCP
// socket (TCP_INFO), and forgets both when the socket closes. A sum over
// the sockets open now therefore goes down when a connection drops and a
// new one replaces it. WireCounter follows each socket by its inode and adds
// up what every socket moved between two reads: the totals only grow.
//
// What a socket moves after the last read before it closes is not seen
// (call Read at each step's boundaries: at most one step of a dropped
// connection's bytes). A socket first seen after the counter was made is
// counted from its first byte: it was opened during the run.
#ifndef MORSE_WORKER_WIRE_COUNTER_H_
#define MORSE_WORKER_WIRE_COUNTER_H_

#include <sys/types.h>

#include <cstdint>
#include <map>

namespace morse::worker {

class WireCounter {
 public:
  struct Bytes {
    uint64_t sent = 0, received = 0;
  };

  // Takes the sockets open now as the start: their bytes so far are not
  // counted.
  WireCounter();

  // The bytes sent and received since construction, summed over every TCP
  // socket this process has had open at a Read. Never decreases.
  Bytes Read();

 private:
  // Each open TCP socket's counters as last read, by inode.
  using Sockets = std::map<ino_t, Bytes>;
  static Sockets Scan();

  Sockets last_;
  Bytes total_;
};

}  // namespace morse::worker

#endif  // MORSE_WORKER_WIRE_COUNTER_H_
