// Allocation throughput of one tenant across threads and processes, with and without the shim.
// Each benchmark starts P alloc_worker processes of T threads over the null driver (so the
// driver's own cost is a few nanoseconds and what the shim adds shows), releases them together and
// times the span from the first worker's start to the last one's end. Every allocation of the
// tenant, in any process, does an atomic add on its process's ledger slot and reads all the
// tenant's slots (common/src/ledger.cpp), so this measures what that cross-process traffic on
// shared cache lines costs as processes and threads are added. perf/alloc_throughput.sh runs it
// and prints the table of docs/performance.md.
//
// The same run measures the baseline (no shim) for each (P, T), next to the shim, so ratios are
// taken between figures measured minutes apart at most. This process never loads the shim: only
// the workers' environment preloads it.
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

extern char** environ;

namespace {

// Pairs (alloc + free) per iteration, over all threads of all processes: the same total work for
// every (P, T), so each benchmark takes about as long whatever the oversubscription: about 0.15 s
// with the shim on one core (many scheduler time slices), 15 ms without.
constexpr uint64_t kPairsPerIteration = uint64_t{1} << 21;
constexpr size_t kAllocBytes = 4096;
// 8 processes x 16 threads (128 threads) is left out: the oversubscribed rows up to 64 already show
// the trend, and the run stays within a few minutes.
constexpr int kMaxTotalThreads = 64;
// Far above what the workers ever hold at once (one allocation per thread): nothing is denied, so
// the figures are of the granting path. The workers count failures and the benchmark errors out.
constexpr const char* kMemoryLimit = "1TiB";

std::string childLdLibraryPath() {
  std::string path = CUSHARE_NULL_DRIVER_DIR;
  if (const char* old = std::getenv("LD_LIBRARY_PATH"); old && *old) path += std::string(":") + old;
  return path;
}

// This process's environment without LD_PRELOAD, LD_LIBRARY_PATH and any CUSHARE_* (the shim
// refuses unknown ones; the known ones are set here or not at all), plus what the mode needs.
std::vector<std::string> childEnvironment(const std::string& ledgerDir) {
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    const std::string_view v(*e);
    if (v.starts_with("LD_PRELOAD=") || v.starts_with("LD_LIBRARY_PATH=") ||
        v.starts_with("CUSHARE_"))
      continue;
    env.emplace_back(v);
  }
  env.push_back("LD_LIBRARY_PATH=" + childLdLibraryPath());
  if (!ledgerDir.empty()) {
    env.push_back(std::string("LD_PRELOAD=") + CUSHARE_SHIM_PATH);
    env.push_back("CUSHARE_TENANT=bench");
    env.push_back(std::string("CUSHARE_MEMORY_LIMIT=") + kMemoryLimit);
    env.push_back("CUSHARE_LEDGER_DIR=" + ledgerDir);
  }
  return env;
}

struct Worker {
  pid_t pid = -1;
  int toChild = -1;
  FILE* fromChild = nullptr;
};

// The workers of one iteration. The destructor kills and reaps any still running after an error,
// so no path leaves a child behind.
class Fleet {
 public:
  ~Fleet() {
    for (Worker& w : workers_) {
      if (w.toChild >= 0) ::close(w.toChild);
      if (w.fromChild) std::fclose(w.fromChild);
      if (w.pid > 0) {
        ::kill(w.pid, SIGKILL);
        ::waitpid(w.pid, nullptr, 0);
      }
    }
  }

  // Starts one worker; false with *err on failure.
  bool spawn(const std::vector<std::string>& args, const std::vector<std::string>& env,
             std::string* err) {
    int in[2], out[2];
    // O_CLOEXEC: a worker must not inherit the pipes of the others (a worker blocked on stdin
    // would then never see EOF if the parent died).
    if (::pipe2(in, O_CLOEXEC) != 0) return fail("pipe", err);
    if (::pipe2(out, O_CLOEXEC) != 0) {
      ::close(in[0]);
      ::close(in[1]);
      return fail("pipe", err);
    }
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in[0], STDIN_FILENO);  // dup2 clears O_CLOEXEC
    posix_spawn_file_actions_adddup2(&fa, out[1], STDOUT_FILENO);
    std::vector<char*> argv, envp;
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    for (const std::string& e : env) envp.push_back(const_cast<char*>(e.c_str()));
    envp.push_back(nullptr);
    pid_t pid;
    const int rc = posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&fa);
    ::close(in[0]);
    ::close(out[1]);
    Worker& w = workers_.emplace_back();  // owns the parent's ends from here on
    w.toChild = in[1];
    w.fromChild = ::fdopen(out[0], "r");
    if (!w.fromChild) ::close(out[0]);
    if (rc != 0) {
      errno = rc;
      return fail("posix_spawn " + args[0], err);
    }
    w.pid = pid;
    return w.fromChild || fail("fdopen", err);
  }

  struct Result {
    uint64_t spanNs = 0;  // from the first worker's start to the last one's end
    uint64_t cpuNs = 0;   // CPU time of all workers' threads in their timed loops
  };

  // Waits until every worker is ready and starts them all. False with *err on failure or if any
  // allocation failed.
  bool run(Result* result, std::string* err) {
    char line[128];
    for (Worker& w : workers_)
      if (!std::fgets(line, sizeof line, w.fromChild) || std::strcmp(line, "ready\n") != 0) {
        *err = "a worker did not get ready (its error is on stderr)";
        return false;
      }
    for (Worker& w : workers_)
      if (::write(w.toChild, "g", 1) != 1) return fail("write to a worker", err);
    uint64_t first = UINT64_MAX, last = 0, cpu = 0, failed = 0;
    for (Worker& w : workers_) {
      uint64_t start, end, c, f;
      if (!std::fgets(line, sizeof line, w.fromChild) ||
          std::sscanf(line, "%" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64, &start, &end, &c, &f) !=
              4) {
        *err = "a worker did not report (its error is on stderr)";
        return false;
      }
      first = std::min(first, start);
      last = std::max(last, end);
      cpu += c;
      failed += f;
    }
    for (Worker& w : workers_) {
      int status;
      const bool reaped = ::waitpid(w.pid, &status, 0) == w.pid;
      if (reaped) w.pid = -1;
      if (!reaped || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        *err = "a worker exited abnormally";
        return false;
      }
    }
    if (failed > 0) {
      *err = std::to_string(failed) +
             " alloc+free pairs failed: these would be figures of a failing "
             "path (a limit too low, or the shim refusing to start)";
      return false;
    }
    *result = {std::max<uint64_t>(last - first, 1), cpu};
    return true;
  }

 private:
  static bool fail(const std::string& what, std::string* err) {
    *err = what + ": " + std::strerror(errno);
    return false;
  }

  std::vector<Worker> workers_;
};

// A fresh ledger directory per benchmark: the tenant ledger then has exactly P slots in use, as a
// tenant with P processes would (slot_hwm never decreases, so a shared directory would make every
// later benchmark scan the slots of the widest one). tmpfs, like the default /dev/shm/cushare.
class LedgerDir {
 public:
  explicit LedgerDir(bool create) {
    char templ[] = "/dev/shm/cushare-bench.XXXXXX";
    if (create && ::mkdtemp(templ)) path_ = templ;
  }
  ~LedgerDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

void allocThroughput(benchmark::State& state, bool withShim) {
  const auto procs = static_cast<int>(state.range(0));
  const auto threads = static_cast<int>(state.range(1));
  const uint64_t perThread = kPairsPerIteration / (procs * threads);
  const LedgerDir dir(withShim);
  if (withShim && dir.path().empty()) {
    state.SkipWithError("cannot create a ledger directory under /dev/shm");
    return;
  }
  const std::vector<std::string> env = childEnvironment(withShim ? dir.path() : std::string());
  const std::vector<std::string> args = {CUSHARE_ALLOC_WORKER_PATH, std::to_string(threads),
                                         std::to_string(perThread), std::to_string(kAllocBytes)};
  uint64_t cpuNs = 0;
  for (auto _ : state) {
    std::string err;
    Fleet fleet;
    bool ok = true;
    for (int p = 0; ok && p < procs; ++p) ok = fleet.spawn(args, env, &err);
    Fleet::Result r;
    ok = ok && fleet.run(&r, &err);
    // A preload that cannot be found is only a warning of the dynamic loader, and the figures
    // would silently be the baseline's: the shim's ledger file proves it ran.
    if (ok && withShim && !std::filesystem::exists(dir.path() + "/bench.ledger")) {
      ok = false;
      err = "the workers ran without the shim (no ledger was created)";
    }
    if (!ok) {
      state.SkipWithError(err.c_str());
      break;
    }
    state.SetIterationTime(static_cast<double>(r.spanNs) * 1e-9);
    cpuNs += r.cpuNs;
  }
  const uint64_t pairs = state.iterations() * perThread * procs * threads;
  state.SetItemsProcessed(static_cast<int64_t>(pairs));
  // Time slicing and other load on the host leave this alone; contention on shared cache lines
  // and spinning on a lock raise it.
  state.counters["cpu_ns_per_pair"] = pairs ? static_cast<double>(cpuNs) / pairs : 0;
}

// The baseline and the shim of one (P, T) are registered next to each other, so that even
// without --benchmark_enable_random_interleaving they are measured close in time.
void registerAll() {
  for (int procs : {1, 2, 4, 8})
    for (int threads : {1, 2, 4, 8, 16}) {
      if (procs * threads > kMaxTotalThreads) continue;
      for (const bool withShim : {false, true})
        benchmark::RegisterBenchmark(withShim ? "shim" : "baseline", allocThroughput, withShim)
            ->ArgNames({"procs", "threads"})
            ->Args({procs, threads})
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond);
    }
}

}  // namespace

int main(int argc, char** argv) {
  // A worker that died must turn into an error message, not kill this process when the start
  // byte is written to its pipe. (Workers inherit the ignored SIGPIPE: they write two lines to a
  // parent that outlives them.)
  ::signal(SIGPIPE, SIG_IGN);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  registerAll();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
