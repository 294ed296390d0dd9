#include "core/probes.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "core/log.h"
#include "cushare/parse.h"
#include "cushare/probe_file.h"

namespace cushare::broker {
namespace {

constexpr uint64_t kMs = 1'000'000;
constexpr uint64_t kLead = 20 * kMs;        // a round's instant comes this long after it is asked
constexpr uint64_t kCollect = 1000 * kMs;   // results not written within this of the instant: lost
constexpr uint64_t kActiveSlot = 10'000 * kMs;  // a process that launched within this is asked
constexpr size_t kMaxRounds = 6;  // rounds asked and not all answered: at most this many (kProbeFileAnswers - 2)
// A record's start within this of a launch's host clock tells which clock %globaltimer follows.
constexpr uint64_t kClockMatch = 60'000 * kMs;

uint64_t realtimeNs() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1'000'000'000u + static_cast<uint64_t>(ts.tv_nsec);
}

}  // namespace

ProbeScheduler::ProbeScheduler(const ProbeConfig& config, std::string ledgerDir, size_t devices)
    : config_(config), ledgerDir_(std::move(ledgerDir)), devices_(devices), rng_(std::random_device{}()) {}

ProbeScheduler::~ProbeScheduler() {
  for (auto& [name, fd] : fds_)
    if (fd >= 0) ::close(fd);
}

void ProbeScheduler::configure(const ProbeConfig& config) { config_ = config; }

void ProbeScheduler::forget(const std::string& tenant) {
  warned_.erase(tenant);
  const auto it = fds_.find(tenant);
  if (it == fds_.end()) return;
  if (it->second >= 0) ::close(it->second);
  fds_.erase(it);
  made_.erase(tenant);
  ::unlink((ledgerDir_ + "/" + tenant + ".probe").c_str());
}

// The tenant's probe file: created (owner, group and mode of its ledger) with a valid header if
// missing; one that is not a plain file with one link, the owner, group and mode the tenant's
// ledger has now and a valid header is replaced (a file of the tenant's former user, or of the
// broker's before a tenant's uid was configured, is useless to the tenant or writable by someone
// else). Kept open; made anew when the tenant's owner, group or mode change.
int ProbeScheduler::fileFor(const ProbeTenant& t) {
  const bool asRoot = geteuid() == 0;
  const uid_t owner = asRoot ? t.owner : geteuid();  // only root can give a file away
  if (const auto it = fds_.find(t.name); it != fds_.end()) {
    const auto made = made_.find(t.name);
    if (made != made_.end() && made->second == std::make_tuple(owner, t.gid, t.mode)) return it->second;
    if (it->second >= 0) ::close(it->second);
    fds_.erase(it);
  }
  const std::string path = ledgerDir_ + "/" + t.name + ".probe";
  int fd = ::open(path.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  struct stat st{};
  probe::ProbeFileHeader have{};
  if (fd >= 0 && (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_nlink != 1 || st.st_uid != owner ||
                  (asRoot && t.gid >= 0 && st.st_gid != static_cast<gid_t>(t.gid)) ||
                  (st.st_mode & 07777) != t.mode ||
                  st.st_size != static_cast<off_t>(probe::kProbeFileBytes) ||
                  ::pread(fd, &have, sizeof have, 0) != static_cast<ssize_t>(sizeof have) ||
                  have.magic != probe::kProbeFileMagic || have.version != probe::kProbeFileVersion ||
                  have.answers != probe::kProbeFileAnswers || have.max_records != probe::kProbeFileMaxRecords)) {
    ::close(fd);
    fd = -1;
  }
  if (fd < 0) {
    ::unlink(path.c_str());  // whatever was there (a link, a device, another user's file)
    fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, t.mode);
    if (fd < 0) {
      // Tried again at the next round (something was put there between the unlink and the
      // create); said once.
      if (warned_.insert(t.name).second)
        CUSHARE_BLOG(warn, "tenant {}: cannot create its probe file {}: {}", t.name, path, std::strerror(errno));
      return -1;
    }
    probe::ProbeFileHeader h{};
    h.magic = probe::kProbeFileMagic;
    h.version = probe::kProbeFileVersion;
    h.answers = probe::kProbeFileAnswers;
    h.max_records = probe::kProbeFileMaxRecords;
    const bool ok = ::ftruncate(fd, static_cast<off_t>(probe::kProbeFileBytes)) == 0 &&
                    ::pwrite(fd, &h, sizeof h, 0) == static_cast<ssize_t>(sizeof h) &&
                    (!asRoot || ::fchown(fd, t.owner, static_cast<gid_t>(t.gid)) == 0) &&
                    ::fchmod(fd, t.mode) == 0;
    if (!ok) {
      if (warned_.insert(t.name).second)
        CUSHARE_BLOG(warn, "tenant {}: cannot prepare its probe file {}: {}", t.name, path, std::strerror(errno));
      ::close(fd);
      ::unlink(path.c_str());
      return -1;
    }
  }
  warned_.erase(t.name);
  fds_[t.name] = fd;
  made_[t.name] = std::make_tuple(owner, t.gid, t.mode);
  return fd;
}

// Reads the tenant's answer if it is there: false while it is not (or never will be: then the
// round's deadline drops it). Untrusted bytes: every size checked here, the records by analysis.
bool ProbeScheduler::collect(int fd, Pending* p, uint32_t* smCount, std::string* why) {
  probe::ProbeAnswerHeader h{};
  const size_t base = probe::probeAnswerOffset(p->seq);
  if (::pread(fd, &h, sizeof h, static_cast<off_t>(base)) != static_cast<ssize_t>(sizeof h)) return false;
  if (h.seq != p->seq) return false;
  p->done = true;
  if (h.status != probe::kProbeOk) {
    // The tenant's own bytes: at most the field, NUL or not, and printable only.
    *why = "answered without records: " +
           printable(std::string(h.error, ::strnlen(h.error, sizeof h.error)), sizeof h.error);
    return true;
  }
  if (h.sm_count == 0 || h.sm_count > probe::kMaxSmId) {
    *why = "answered with a multiprocessor count of " + std::to_string(h.sm_count);
    return true;
  }
  why->clear();
  *smCount = h.sm_count;
  p->probes.waited_at_gate = (h.flags & probe::kAnswerFirstLaunchWaitedAtGate) != 0;
  std::vector<uint8_t> bytes;
  for (const probe::ProbeFileLaunch& l : h.launches) {
    if (l.kind == 0) continue;
    if (l.kind > probe::kProbeTick || l.blocks == 0 || l.first_record >= probe::kProbeFileMaxRecords ||
        l.blocks > probe::kProbeFileMaxRecords - l.first_record)
      return true;  // a launch that does not fit the file: nothing of this tenant's round counts
    bytes.resize(size_t{l.blocks} * sizeof(probe::BlockRecord));
    const off_t at =
        static_cast<off_t>(base + sizeof(probe::ProbeAnswerHeader) + size_t{l.first_record} * sizeof(probe::BlockRecord));
    if (::pread(fd, bytes.data(), bytes.size(), at) != static_cast<ssize_t>(bytes.size())) return true;
    probe::ProbeLaunch launch;
    std::string err;
    if (!probe::decodeRecords(bytes, l.blocks, &launch.records, &err)) return true;
    launch.ctx.kind = static_cast<probe::ProbeKind>(l.kind);
    launch.ctx.budget_ns = l.budget_ns;
    launch.ctx.grid_blocks = l.blocks;
    launch.ctx.work_per_step = l.work_per_step;
    launch.ctx.sm_count = h.sm_count;
    // Realtime here; finish() puts it in the device's clock. Only when the thread was idle at
    // the instant (kAnswerIdleAtInstant): a late launch then is the host's delay, not a wait at
    // the tenant's gate.
    if (h.flags & probe::kAnswerIdleAtInstant) launch.ctx.launch_ns = l.launch_realtime_ns;
    for (const probe::BlockRecord& r : launch.records)
      if (r.start_ns != 0 && (p->firstStart == 0 || r.start_ns < p->firstStart)) p->firstStart = r.start_ns;
    if (p->launchRealtime == 0) {
      p->launchRealtime = l.launch_realtime_ns;
      p->launchMonotonic = l.launch_monotonic_ns;
    }
    p->probes.launches.push_back(std::move(launch));
  }
  return true;
}

void ProbeScheduler::step(size_t d, uint64_t nowMono, std::vector<ProbeTenant>& tenants,
                          const std::function<bool(const std::function<void()>&)>& guarded) {
  if (d >= devices_.size()) return;
  Device& dev = devices_[d];
  if (!config_.on) {
    dev.rounds.clear();
    return;
  }
  if (!dev.agg) {
    dev.agg = std::make_unique<probe::ShareAggregator>(probe::SoloBaseline{});
    dev.windowStart = nowMono;
  }
  for (size_t i = 0; i < dev.rounds.size();) {
    Round& r = dev.rounds[i];
    bool all = true;
    uint32_t sms = 0;
    for (auto& [name, p] : r.tenants) {
      if (p.done) continue;
      const auto it = fds_.find(name);
      std::string why;
      if (it == fds_.end() || it->second < 0 || !collect(it->second, &p, &sms, &why)) {
        all = false;
        continue;
      }
      if (why.empty()) dev.answerError.erase(name);
      else dev.answerError[name] = why;
    }
    if (all || nowMono >= r.deadlineMono) {
      Round done = std::move(r);
      dev.rounds.erase(dev.rounds.begin() + static_cast<std::ptrdiff_t>(i));
      finish(d, dev, std::move(done));
    } else {
      ++i;
    }
  }
  if (nowMono - dev.windowStart >= uint64_t{config_.windowS} * 1000 * kMs) {
    dev.last.clear();
    for (probe::TenantWindow& w : dev.agg->window()) dev.last[w.tenant] = std::move(w);
    dev.lastLength = nowMono - dev.windowStart;
    dev.agg->reset();
    dev.windowStart = nowMono;
  }
  if (nowMono < dev.nextMono || dev.rounds.size() >= kMaxRounds) return;
  // A new round every interval, whether the last ones are answered or not: a tenant whose probes
  // wait for its turn answers late, and waiting for it would lock the rounds to the turns. The
  // instant a little ahead (every process is asked in time), at a random phase within the
  // interval (rounds do not keep falling on the same part of a scheduling period).
  const uint64_t interval = uint64_t{config_.intervalMs} * kMs;
  dev.nextMono = nowMono + interval;
  const uint64_t jitter = std::uniform_int_distribution<uint64_t>(0, std::max<uint64_t>(interval, 1))(rng_);
  Round r;
  r.atRealtime = realtimeNs() + kLead + jitter;
  r.deadlineMono = nowMono + kLead + jitter + kCollect;
  for (ProbeTenant& t : tenants) {
    if (t.ledger == nullptr || t.entry < 0) continue;
    // The process that launched most lately on the device (paced launches stamp activity_ns),
    // else the one with the most busy time there (metered: it has a pacer thread to answer).
    int slot = -1;
    uint64_t latest = 0, busiest = 0;
    const uint64_t nowNs = nowMono;
    const bool ok = guarded([&] {
      int busySlot = -1;
      for (const Ledger::SlotUsage& u : t.ledger->slots()) {
        if (u.pid == 0 || u.slot < 0) continue;
        const LedgerComputeSlot* c = t.ledger->computeSlotAt(t.entry, u.slot);
        const uint64_t a = c->activity_ns.load(std::memory_order_relaxed);
        if (a != 0 && a <= nowNs && nowNs - a < kActiveSlot && a > latest) {
          latest = a;
          slot = u.slot;
        }
        const uint64_t b = c->busy_ns.load(std::memory_order_relaxed);
        if (b > busiest) {
          busiest = b;
          busySlot = u.slot;
        }
      }
      if (slot < 0) slot = busySlot;
      // A probe file only for a tenant with a process to answer (made before the request).
      if (slot < 0 || fileFor(t) < 0) {
        slot = -1;
        return;
      }
      LedgerComputeDevice* w = t.ledger->compute(t.entry);
      w->probe_slot.store(static_cast<uint32_t>(slot), std::memory_order_relaxed);
      w->probe_at_ns.store(r.atRealtime, std::memory_order_relaxed);
      w->probe_what.store(config_.kinds, std::memory_order_relaxed);
      w->probe_budget_us.store(config_.budgetUs, std::memory_order_relaxed);
      w->probe_seq.store(++seq_ == 0 ? ++seq_ : seq_, std::memory_order_release);
    });
    if (!ok || slot < 0) continue;
    Pending p;
    p.seq = seq_;
    p.work = t.work;
    p.regime = t.regime;
    r.tenants[t.name] = std::move(p);
  }
  if (!r.tenants.empty()) dev.rounds.push_back(std::move(r));
}

// A round's answers into the window: the instant in the device's clock (%globaltimer follows the
// host's realtime clock on NVIDIA GPUs, the monotonic one on simgpu), judged for each tenant from
// its own launches' stamps: a tenant's records can only place its own samples in time, never
// another's (the instant used to come from the first tenant whose records matched its stamps,
// so a tenant could move every tenant's instant). The rolling baseline is fed with every launch.
void ProbeScheduler::finish(size_t d, Device& dev, Round r) {
  probe::Round round;
  uint32_t sms = 0;
  for (auto& [name, p] : r.tenants) {
    if (!p.done) continue;
    probe::TenantRound tr;
    tr.tenant = name;
    tr.regime = p.regime;
    tr.has_work = p.work;
    if (!p.probes.launches.empty()) {
      sms = p.probes.launches.front().ctx.sm_count;
      const uint64_t start =
          probe::instantInRecordsClock(r.atRealtime, p.firstStart, p.launchRealtime, p.launchMonotonic, kClockMatch);
      if (p.firstStart == 0) {
        tr.contexts.push_back(std::move(p.probes));  // no start to place: the analysis says why
      } else if (start == 0) {
        tr.error = "probe records follow neither of the host's clocks at their launch";
      } else {
        const uint64_t realtimeAhead = r.atRealtime - start;  // 0 when the device follows realtime
        for (probe::ProbeLaunch& l : p.probes.launches) {
          l.ctx.round_start_ns = start;
          if (l.ctx.launch_ns != 0)
            l.ctx.launch_ns = l.ctx.launch_ns > realtimeAhead ? l.ctx.launch_ns - realtimeAhead : 0;
        }
        if (round.start_ns == 0) round.start_ns = start;
        tr.contexts.push_back(std::move(p.probes));
      }
    }
    round.tenants.push_back(std::move(tr));
  }
  if (round.start_ns == 0) return;  // nobody answered with records in a host clock
  // The baseline: the best any launch did (a round that found the device otherwise idle is
  // solo), and the fastest start of each round (the aggregator's: each context's first launch).
  // Only the parameters: the rates and the latency come from the rolling observations alone (the
  // merged baseline fed back would keep its worst early latency for ever).
  // The baseline's work per step is the shim's, never what a tenant's records claim (a tenant that
  // claimed another made every other tenant's SM launches "differ": no concurrent share at all).
  probe::SoloBaseline base;
  base.sm_work_per_step = probe::kProbeWorkPerStep;
  for (probe::TenantRound& tr : round.tenants)
    for (probe::ContextProbes& c : tr.contexts)
      for (probe::ProbeLaunch& l : c.launches) {
        probe::LaunchNumbers n;
        std::string err;
        if (probe::analyzeLaunch(l.records, l.ctx, &n, &err) != probe::LaunchOutcome::kNumbers) continue;
        if (l.ctx.kind == probe::kProbeSm) {
          base.sm_count = l.ctx.sm_count;  // per-SM factors do not depend on it
          base.sm_budget_ns = l.ctx.budget_ns;
        } else if (l.ctx.kind == probe::kProbeMem) {
          base.mem_budget_ns = l.ctx.budget_ns;
        }
        if (n.sm_count == 0) n.sm_count = sms;
        CUSHARE_BLOG(debug, "probe round device {} tenant {} kind {} latency {:.0f} us", d, tr.tenant,
                     static_cast<int>(l.ctx.kind), n.has_latency ? n.start_latency_ns / 1e3 : -1.0);
        dev.rolling.observe(n);
      }
  dev.agg->setBaseline(dev.rolling.merged(base));
  const size_t starts = dev.agg->fastestStarts().size();
  for (const std::string& line : dev.agg->addRound(round))
    CUSHARE_BLOG(debug, "probe round on device {}: {}", d, line);
  if (dev.agg->fastestStarts().size() > starts)
    dev.rolling.observeRoundFastestStart(dev.agg->fastestStarts().back());
}

std::optional<ProbeView> ProbeScheduler::view(const std::string& tenant, size_t d) const {
  if (d >= devices_.size()) return std::nullopt;
  const Device& dev = devices_[d];
  ProbeView v;
  if (const auto it = dev.last.find(tenant); it != dev.last.end()) {
    v.known = true;
    v.window = it->second;
    v.windowNs = dev.lastLength;
    v.complete = true;
  } else if (dev.agg) {
    for (probe::TenantWindow& w : dev.agg->window())
      if (w.tenant == tenant) {
        v.known = true;
        v.window = std::move(w);
        break;
      }
  }
  // An answer without records says why the tenant is not measured (or not any more).
  if (const auto e = dev.answerError.find(tenant); e != dev.answerError.end()) {
    if (!v.known) v.window.tenant = tenant;
    v.known = true;
    if (v.window.last_error.empty()) v.window.last_error = e->second;
  }
  if (!v.known) return std::nullopt;
  return v;
}

}  // namespace cushare::broker
