#include "worker/wire_counter.h"

#include <dirent.h>
#include <linux/tcp.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <cstdlib>
#include <utility>

namespace morse::worker {

WireCounter::WireCounter() : last_(Scan()) {}

WireCounter::Sockets WireCounter::Scan() {
  Sockets sockets;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return sockets;
  while (dirent* entry = readdir(dir)) {
    const int fd = std::atoi(entry->d_name);
    struct stat st;
    if (fd <= 2 || fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
    tcp_info info{};
    socklen_t len = sizeof info;
    if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) != 0) continue;
    sockets[st.st_ino] = {info.tcpi_bytes_acked, info.tcpi_bytes_received};
  }
  closedir(dir);
  return sockets;
}

WireCounter::Bytes WireCounter::Read() {
  Sockets now = Scan();
  for (const auto& [inode, bytes] : now) {
    Bytes before;  // a new socket: everything it moved is this run's
    if (auto it = last_.find(inode); it != last_.end()) before = it->second;
    // A socket's counters only grow (sockfs numbers sockets from a counter,
    // so an inode is not another socket's; the guard is for the impossible).
    if (bytes.sent >= before.sent) total_.sent += bytes.sent - before.sent;
    if (bytes.received >= before.received)
      total_.received += bytes.received - before.received;
  }
  last_ = std::move(now);
  return total_;
}

}  // namespace morse::worker
