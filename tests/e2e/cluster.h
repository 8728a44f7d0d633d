// Test helpers that run real morse-server and morse-worker processes on
// loopback: free ports, child processes with logs, a job directory, and
// readers for the JSON lines the daemons write.
#ifndef MORSE_TESTS_E2E_CLUSTER_H_
#define MORSE_TESTS_E2E_CLUSTER_H_

#include <signal.h>
#include <sys/types.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace morse::testing {

// A port on 127.0.0.1 that was free a moment ago, and that no earlier call
// in this process returned.
int FreePort();

// The daemons the tests run: $MORSE_SERVER_BIN / $MORSE_WORKER_BIN if set;
// else <test binary's folder>/../bin/NAME if it exists (a bundle made by
// deploy/bundle.sh); else this build tree's (compiled in).
std::string ServerBin();
std::string WorkerBin();

// A child process whose stdout and stderr go to a log file. Killed (SIGKILL)
// on destruction if still running.
class Process {
 public:
  Process(const std::vector<std::string>& argv, const std::string& log_path);
  ~Process();
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  // True with the exit code (128 + the signal if one ended it) if the process
  // ended within the timeout; the same answer again once it has ended.
  bool Wait(absl::Duration timeout, int* exit_code);
  void Signal(int sig);
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
  bool reaped_ = false;
  int exit_code_ = -1;
};

// A job directory with a config and S server addresses.
class Cluster {
 public:
  Cluster(const std::string& config_text, int shards, int workers);
  ~Cluster();

  const std::string& dir() const { return dir_; }
  std::string config_path() const { return dir_ + "/job.textproto"; }
  std::string servers() const;  // host:port,host:port
  std::string server_address(int shard) const;

  // Arguments appended to every server's or worker's command line.
  void AddServerArgs(std::vector<std::string> args) {
    server_args_ = std::move(args);
  }
  void AddWorkerArgs(std::vector<std::string> args) {
    worker_args_ = std::move(args);
  }
  // NAME=VALUE settings added to one shard's or one worker's environment
  // (e.g. MORSE_SIMD=scalar), through /usr/bin/env, which execs the daemon.
  void SetServerEnv(int shard, std::vector<std::string> env) {
    server_env_[shard] = std::move(env);
  }
  void SetWorkerEnv(int rank, std::vector<std::string> env) {
    worker_env_[rank] = std::move(env);
  }
  // Credential flags of the servers and workers (default: --insecure).
  void SetSecurity(std::vector<std::string> server,
                   std::vector<std::string> worker) {
    server_security_ = std::move(server);
    worker_security_ = std::move(worker);
  }

  void StartServers(bool state_logs);
  void StartWorkers(bool checksums);
  void StartWorker(int rank, bool checksums);
  // Waits for every worker; true if all exited 0 within the timeout.
  bool WaitWorkers(absl::Duration timeout, std::string* failure);
  void StopServers();  // SIGTERM, then wait
  // kill -9 of one shard (waits until it is gone), and its restart with the
  // same command line (its log continues in server<s>.restart<n>.log; the
  // state log is appended to).
  void KillServer(int shard);
  void SignalWorker(int rank, int sig) { workers_procs_[rank]->Signal(sig); }
  // kill -9 of one worker (waits until it is gone), and its restart with the
  // same command line (its log and metrics in worker<r>.restart<n>.log and
  // .jsonl: restarted_worker_log/metrics).
  void KillWorker(int rank);
  void RestartWorker(int rank, bool checksums);
  std::string restarted_worker_log(int rank, int restart) const;
  std::string restarted_worker_metrics(int rank, int restart) const;
  void RestartServer(int shard, bool state_logs);

  std::string worker_log(int rank) const;
  std::string worker_metrics(int rank) const;
  std::string server_log(int shard) const;
  std::string state_log(int shard) const;

 private:
  std::string dir_;
  int shards_, workers_;
  std::vector<int> ports_;
  std::vector<std::string> server_args_, worker_args_;
  std::vector<std::string> server_security_{"--insecure"},
      worker_security_{"--insecure"};
  std::vector<std::unique_ptr<Process>> servers_, workers_procs_;
  int restarts_ = 0;
  std::map<int, int> worker_restarts_;  // rank -> restarts so far
  std::map<int, std::vector<std::string>> server_env_, worker_env_;
  std::unique_ptr<Process> StartServer(int shard, bool state_logs,
                                       const std::string& log);
  std::unique_ptr<Process> StartWorkerProcess(int rank, bool checksums,
                                              const std::string& log,
                                              const std::string& metrics);
};

std::string ReadFile(const std::string& path);
// The string value of "key":"..." or the number of "key":N in each line.
std::vector<std::string> JsonField(const std::string& jsonl,
                                   const std::string& key);

}  // namespace morse::testing

#endif  // MORSE_TESTS_E2E_CLUSTER_H_
