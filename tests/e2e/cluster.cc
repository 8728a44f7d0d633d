#include "tests/e2e/cluster.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"

extern char** environ;

namespace morse::testing {

namespace {

std::string DaemonPath(const char* env, const std::string& name,
                       const char* built) {
  if (const char* path = std::getenv(env); path != nullptr && *path != '\0')
    return path;
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n > 0) {
    std::string dir(self, n);
    dir.resize(dir.rfind('/'));
    const std::string beside = absl::StrCat(dir, "/../bin/", name);
    if (access(beside.c_str(), X_OK) == 0) return beside;
  }
  return built;
}

}  // namespace

std::string ServerBin() {
  return DaemonPath("MORSE_SERVER_BIN", "morse-server", MORSE_BUILT_SERVER);
}
std::string WorkerBin() {
  return DaemonPath("MORSE_WORKER_BIN", "morse-worker", MORSE_BUILT_WORKER);
}

int FreePort() {
  // Drawn below the ephemeral range (net.ipv4.ip_local_port_range), as
  // morse-run draws its ports: a port from bind(0) lies in that range, where
  // any process's next outgoing connection may take it before the daemon
  // binds it. And a port goes out once per process: the same one given to a
  // shard's --listen and its --metrics_listen failed in CI.
  static absl::Mutex mu(absl::kConstInit);
  static auto* given = new absl::flat_hash_set<int>();
  static std::mt19937 random(std::random_device{}());
  absl::MutexLock lock(&mu);
  int low = 32768;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> low;
  std::uniform_int_distribution<int> below(std::max(1024, low - 12000),
                                           std::max(1024, low - 1));
  for (int attempt = 0; attempt < 1000; ++attempt) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(low > 2048 && attempt < 900 ? below(random) : 0);
    socklen_t len = sizeof addr;
    const bool bound =
        fd >= 0 &&
        bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
    if (fd >= 0) close(fd);
    if (bound && given->insert(ntohs(addr.sin_port)).second)
      return ntohs(addr.sin_port);
  }
  std::fprintf(stderr, "FreePort: no new free port on 127.0.0.1\n");
  std::abort();
}

Process::Process(const std::vector<std::string>& argv,
                 const std::string& log_path) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  std::vector<char*> args;
  for (const std::string& a : argv)
    args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  if (posix_spawn(&pid_, args[0], &actions, nullptr, args.data(), environ) != 0)
    pid_ = -1;
  posix_spawn_file_actions_destroy(&actions);
}

Process::~Process() {
  if (pid_ > 0 && !reaped_) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
}

bool Process::Wait(absl::Duration timeout, int* exit_code) {
  if (pid_ <= 0) return false;
  if (reaped_) {
    *exit_code = exit_code_;
    return true;
  }
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    int status = 0;
    const pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      reaped_ = true;
      exit_code_ =
          WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      *exit_code = exit_code_;
      return true;
    }
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
}

void Process::Signal(int sig) {
  if (pid_ > 0 && !reaped_) kill(pid_, sig);
}

Cluster::Cluster(const std::string& config_text, int shards, int workers)
    : shards_(shards), workers_(workers) {
  char pattern[] = "/tmp/morse-e2e-XXXXXX";
  dir_ = mkdtemp(pattern);
  std::ofstream(config_path()) << config_text;
  for (int s = 0; s < shards; ++s) ports_.push_back(FreePort());
}

Cluster::~Cluster() {
  workers_procs_.clear();
  StopServers();
  if (std::getenv("MORSE_KEEP_E2E") == nullptr) {
    std::system(absl::StrCat("rm -rf ", dir_).c_str());
  }
}

std::string Cluster::server_address(int shard) const {
  return absl::StrCat("127.0.0.1:", ports_[shard]);
}

std::string Cluster::servers() const {
  std::vector<std::string> all;
  for (int s = 0; s < shards_; ++s) all.push_back(server_address(s));
  return absl::StrJoin(all, ",");
}

std::string Cluster::worker_log(int rank) const {
  return absl::StrCat(dir_, "/worker", rank, ".log");
}
std::string Cluster::worker_metrics(int rank) const {
  return absl::StrCat(dir_, "/worker", rank, ".jsonl");
}
std::string Cluster::server_log(int shard) const {
  return absl::StrCat(dir_, "/server", shard, ".log");
}
std::string Cluster::state_log(int shard) const {
  return absl::StrCat(dir_, "/server", shard, ".jsonl");
}

namespace {

// `argv` run through /usr/bin/env with `env`'s settings for `index`, if any.
std::vector<std::string> WithEnv(
    const std::map<int, std::vector<std::string>>& env, int index,
    std::vector<std::string> argv) {
  const auto it = env.find(index);
  if (it == env.end() || it->second.empty()) return argv;
  std::vector<std::string> wrapped = {"/usr/bin/env"};
  wrapped.insert(wrapped.end(), it->second.begin(), it->second.end());
  wrapped.insert(wrapped.end(), argv.begin(), argv.end());
  return wrapped;
}

}  // namespace

std::unique_ptr<Process> Cluster::StartServer(int s, bool state_logs,
                                              const std::string& log) {
  std::vector<std::string> argv = {
      ServerBin(),       "--config", config_path(),    "--shard",
      std::to_string(s), "--listen", server_address(s)};
  if (state_logs) argv.push_back("--state_log=" + state_log(s));
  argv.insert(argv.end(), server_security_.begin(), server_security_.end());
  argv.insert(argv.end(), server_args_.begin(), server_args_.end());
  return std::make_unique<Process>(WithEnv(server_env_, s, std::move(argv)),
                                   log);
}

void Cluster::StartServers(bool state_logs) {
  for (int s = 0; s < shards_; ++s)
    servers_.push_back(StartServer(s, state_logs, server_log(s)));
}

void Cluster::KillServer(int shard) {
  servers_[shard]->Signal(SIGKILL);
  int code;
  servers_[shard]->Wait(absl::Seconds(10), &code);
}

void Cluster::RestartServer(int shard, bool state_logs) {
  servers_[shard] = StartServer(
      shard, state_logs,
      absl::StrCat(dir_, "/server", shard, ".restart", ++restarts_, ".log"));
}

std::unique_ptr<Process> Cluster::StartWorkerProcess(
    int rank, bool checksums, const std::string& log,
    const std::string& metrics) {
  std::vector<std::string> argv = {
      WorkerBin(), "--config", config_path(), "--rank", std::to_string(rank),
      "--servers", servers(),  "--metrics",   metrics};
  if (checksums) argv.push_back("--checksums");
  argv.insert(argv.end(), worker_security_.begin(), worker_security_.end());
  argv.insert(argv.end(), worker_args_.begin(), worker_args_.end());
  return std::make_unique<Process>(WithEnv(worker_env_, rank, std::move(argv)),
                                   log);
}

void Cluster::StartWorker(int rank, bool checksums) {
  workers_procs_.push_back(StartWorkerProcess(rank, checksums, worker_log(rank),
                                              worker_metrics(rank)));
}

void Cluster::KillWorker(int rank) {
  workers_procs_[rank]->Signal(SIGKILL);
  int code;
  workers_procs_[rank]->Wait(absl::Seconds(10), &code);
}

void Cluster::RestartWorker(int rank, bool checksums) {
  const int n = ++worker_restarts_[rank];
  workers_procs_[rank] =
      StartWorkerProcess(rank, checksums, restarted_worker_log(rank, n),
                         restarted_worker_metrics(rank, n));
}

std::string Cluster::restarted_worker_log(int rank, int restart) const {
  return absl::StrCat(dir_, "/worker", rank, ".restart", restart, ".log");
}

std::string Cluster::restarted_worker_metrics(int rank, int restart) const {
  return absl::StrCat(dir_, "/worker", rank, ".restart", restart, ".jsonl");
}

void Cluster::StartWorkers(bool checksums) {
  for (int r = 0; r < workers_; ++r) StartWorker(r, checksums);
}

namespace {

// The last `lines` lines of a log, so that a failure's report stays readable
// (a worker retrying a dead shard writes a line every few seconds).
std::string Tail(const std::string& text, int lines) {
  size_t at = text.size();
  for (int n = 0; n <= lines && at != std::string::npos && at > 0; ++n) {
    at = text.rfind('\n', at - 1);
  }
  if (at == std::string::npos || at == 0) return text;
  return absl::StrCat("[...]\n", text.substr(at + 1));
}

}  // namespace

bool Cluster::WaitWorkers(absl::Duration timeout, std::string* failure) {
  const absl::Time deadline = absl::Now() + timeout;
  bool ok = true;
  std::string workers;
  for (size_t r = 0; r < workers_procs_.size(); ++r) {
    int code = -1;
    const absl::Duration left =
        std::max(deadline - absl::Now(), absl::Seconds(1));
    if (!workers_procs_[r]->Wait(left, &code)) {
      absl::StrAppend(&workers, "worker ", r, " did not finish in time\n",
                      Tail(ReadFile(worker_log(r)), 40));
      ok = false;
    } else if (code != 0) {
      absl::StrAppend(&workers, "worker ", r, " exited ", code, ":\n",
                      Tail(ReadFile(worker_log(r)), 40));
      ok = false;
    }
  }
  if (ok) return true;
  // The shards first: a worker that fails is most often waiting on one that
  // ended (exit code, 128 + signal) or stopped answering.
  for (size_t s = 0; s < servers_.size(); ++s) {
    int code = -1;
    const bool ended = servers_[s]->Wait(absl::ZeroDuration(), &code);
    absl::StrAppend(failure, "server ", s,
                    ended ? absl::StrCat(" ended with ", code) : " running",
                    "; its log:\n", Tail(ReadFile(server_log(s)), 40), "\n");
  }
  absl::StrAppend(failure, workers);
  return false;
}

void Cluster::StopServers() {
  for (auto& s : servers_) s->Signal(SIGTERM);
  for (auto& s : servers_) {
    int code;
    if (!s->Wait(absl::Seconds(10), &code)) s->Signal(SIGKILL);
  }
  servers_.clear();
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::vector<std::string> JsonField(const std::string& jsonl,
                                   const std::string& key) {
  std::vector<std::string> values;
  const std::string needle = "\"" + key + "\":";
  for (absl::string_view line :
       absl::StrSplit(jsonl, '\n', absl::SkipEmpty())) {
    const size_t at = line.find(needle);
    if (at == absl::string_view::npos) continue;
    absl::string_view rest = line.substr(at + needle.size());
    if (!rest.empty() && rest[0] == '"') {
      rest.remove_prefix(1);
      values.emplace_back(rest.substr(0, rest.find('"')));
    } else {
      values.emplace_back(rest.substr(0, rest.find_first_of(",}")));
    }
  }
  return values;
}

}  // namespace morse::testing
