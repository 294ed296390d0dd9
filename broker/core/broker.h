// The broker's state: the configuration in force, the host's devices, every tenant's ledger and
// limits, live overrides. One mutex guards it all; each public method takes it, so the control
// server, the metrics server and the reaper may call in from their own threads.
//
// Invariants:
// - The limit written in a managed tenant's ledger is the broker's "expected" limit: the live
//   override if there is one, else the configured (or unknown-tenant profile) limit. tick()
//   restores it if anyone else changed it (a tenant can write its own ledger).
// - A configuration change (start, reload) is all or nothing: everything that can fail is checked
//   before the first ledger, limit or file is touched.
// - The host segment is written at start after the ledgers it implies exist, so a shim that sees a
//   broker also finds its tenant's ledger. On reload it is written before anything else changes
//   (it names no tenant): a reload whose segment cannot be written is refused as a whole.
// - Nothing a tenant process holds is ever lost: removed tenants' ledgers are unlinked (new
//   processes are refused) but kept open and reaped until their last process is gone.
// - No configuration step raises a running process's limit by taking its tenant out: a tenant
//   that leaves the configuration keeps at most the limit it last had (its ceiling), also across
//   restarts (the state file records it).
// - A tenant's ledger is owned by its configured user. One found with another owner is renamed
//   away (never handed over: its creator keeps a writable descriptor) and replaced; what its
//   processes hold stays charged to the tenant until they exit (shadows), never a second budget.
// - Unknown tenants are bounded: at most max_unknown_tenants of them (and per uid) hold a
//   descriptor and a mapping; the others' files are refused, remembered by name only while they
//   exist.
// - A tenant's ledger is written by its processes, so nothing in it is trusted: the broker touches
//   a ledger's mapping only inside guarded() (a truncated file faults), never waits for a ledger's
//   flock under mu_ (one bounded wait per tick, outside it), and every tick compares each tenant's
//   ledger with the device's own per-process accounting (NVML) and charges, in a slot of its own
//   in the ledger, what the device holds for the tenant beyond what the ledger shows
//   (hidden_memory.cpp).
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <array>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "config/config.h"
#include "core/devices.h"
#include "core/log_limit.h"
#include "core/overrides.h"
#include "core/snapshot.h"
#include "cushare/ledger.h"

namespace cushare::broker {

// Ticks in a row that must find memory beyond a tenant's ledger before it is charged as hidden
// (hidden_memory.cpp): an honest allocation made and freed between the broker's two reads of the
// ledger in one tick is seen on the device and in neither read.
inline constexpr size_t kHiddenTicks = 5;

// a + b, or UINT64_MAX where that would wrap: sums of counters a tenant writes.
inline uint64_t addSaturated(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }

class ProbeScheduler;

struct EnvInfo {
  std::string tenant;
  std::string ledgerDir;
  std::string source;  // "config" or "unknown-tenant"
  std::optional<int> threadPercentage;
  Priority priority = Priority::kNormal;
  std::vector<std::pair<std::string, uint64_t>> limits;  // per device: uuid, limit (kNoLimit: none)
};

// Who is asking, from the socket's peer credentials.
struct Peer {
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;  // supplementary
  pid_t pid = 0;
};

class Broker {
 public:
  Broker(std::string configPath, std::vector<DeviceInfo> devices);
  ~Broker();

  // Loads the configuration and the state file, prepares the ledger directory, creates or
  // re-adopts every tenant's ledger, writes the host segment. False with one line on failure.
  bool start(std::string* err);
  // Everything start() checks, without touching any file: for cushare-broker --check.
  bool check(std::string* err) const;
  // Re-reads the configuration file; on any failure nothing changes.
  bool reload(std::string* err);
  // A live limit for tenant on device (-1: every device); nullopt: drop the override.
  bool setLimit(const std::string& tenant, int device, std::optional<MemoryAmount> amount,
                std::string* err) {
    LimitChange c;
    c.device = device;
    c.memory = true;
    c.amount = amount;
    return setLimit(tenant, c, err);
  }
  // What one `cushare set-limit` changes; all of it or nothing.
  struct LimitChange {
    int device = -1;                     // memory: the device (-1: every device)
    bool memory = false;                 // change the memory limit:
    std::optional<MemoryAmount> amount;  //   to this; nullopt: drop the override
    std::optional<int> threads;          // a live compute cap, 1..100 percent
    std::optional<Priority> priority;    // a live priority
    bool resetCompute = false;           // drop the live cap and priority
  };
  bool setLimit(const std::string& tenant, const LimitChange& change, std::string* err);
  bool env(const std::string& tenant, EnvInfo* out, std::string* err) const;
  // May this peer change things (set-limit, reload)? Root, the broker's own user, or a member of
  // admin_group.
  bool isAdmin(const Peer& p) const;

  // Not const: a ledger found unreadable while reading it is dropped (see faultLocked).
  BrokerSnapshot snapshot();
  // What the start found of the mig: layout (main.cpp), shown in metrics.
  void setMigLayout(BrokerSnapshot::MigLayout m);
  // The same with each process's Kubernetes container (pod_labels.h) when pod labels are on:
  // reads each process's mount table, so only for the metrics and `cushare processes`.
  BrokerSnapshot snapshotWithPods();
  // Turns pod labels on (main, before serving); null: off.
  void setPodLabeler(std::shared_ptr<PodLabeler> labeler);

  // Housekeeping, from the reaper: returns dead processes' usage, adopts ledgers that appeared in
  // the directory, restores tampered limits, charges memory hidden from the ledgers, drops removed
  // tenants with no process left. Returns the number of processes reaped. Waits (at most once,
  // about 100 ms, without holding the broker's lock) for ledgers whose flock another process holds.
  int tick(bool scanDirectory);
  // The pids in every ledger's slots, for the reaper's pidfds.
  std::vector<int> pids();

  // The compute scheduler's step (compute.cpp; docs/compute.md): meters every tenant's busy and
  // throttled time, writes each ledger's compute words, and runs the exclusive turns on devices
  // where a tenant is capped. Returns how long to sleep before the next step.
  std::chrono::microseconds computeTick();
  // At stop: every gate opened, pacing off (metering stays on), so tenants run on unpaced.
  void computeRelease();

  void setMetricsAddress(std::string a);
  // What the MPS supervisor last saw (core/mps_daemon.h); snapshot() carries it.
  void setMpsSnapshot(MpsSnapshot m);
  const std::string& ledgerDir() const { return ledgerDir_; }
  // The configuration in force (the file at start or at the last accepted reload).
  Config config() const;
  std::string socketPath() const;
  std::string metricsHost() const;
  uint16_t metricsPort() const;

 private:
  struct TenantState {
    std::string name;
    std::string source;  // "config", "unknown-tenant", "removed"
    Tenant config;       // the configured tenant, or the profile's fields for an unknown one
    std::vector<uint64_t> configured;  // per device: the configured limit (kNoLimit: none)
    std::vector<uint64_t> burstAbove;  // per device: its guarantee where it bursts into managed memory (kNoLimit: it does not)
    std::vector<uint64_t> guaranteeOf;  // per device: its guarantee where it bursts, either way (kNoLimit: it does not)
    // Reclaim of its plain bursts (elasticity.cpp), per device: what it held when the episode
    // began, the target it was given (kNoLimit: none), when it reached it (0: not yet), the limit
    // clamp past the deadline (kNoLimit: none) and the last episode's time to reach the target.
    std::vector<uint64_t> reclaimFrom, reclaimTarget, reclaimReachedNs, reclaimClamp, reclaimJoinNs;
    std::vector<double> reclaimSeconds;
    // Per device, where it bursts: the most memory the device cannot evict (NVML's per-process
    // figures, which leave managed memory out) its processes may hold: its guarantee, or what they
    // held beyond it when the broker first looked or the guarantee was lowered, going down as they
    // free (hidden_memory.cpp); kNoLimit where it does not burst. ordinarySet: measured once.
    std::vector<uint64_t> ordinaryCeiling;
    std::vector<uint8_t> ordinarySet;
    // Per device (elasticity.cpp): its bursts on host memory now (an estimate) and the bytes of
    // them found gone there since the broker started (a counter); burstHostSaid: said in the log.
    std::vector<uint64_t> burstHost, reclaimed;
    // Its burst at the last tick: a rise on host memory that its burst's own growth explains (an
    // allocation not yet prefetched, or one that found no room) is not a reclaim.
    std::vector<uint64_t> burstBefore;
    std::vector<uint8_t> burstHostSaid;
    // Per device: what its processes hold above its guarantee where it bursts into managed memory
    // (its ledger, bounded by its limit; elasticity.cpp, every tick), for the thrashing guard.
    std::vector<uint64_t> managedBurst;
    // When burstAbove last changed, in /proc's clock ticks since boot (process start times): a
    // process started after it cannot have honestly taken more than the guarantee.
    uint64_t burstSinceTicks = 0;
    std::unique_ptr<Ledger> ledger;
    std::string fileName;    // in ledger_dir: "<name>.ledger", or "<name>.ledger.removed"
    std::vector<int> entry;  // per device: the ledger's device entry (refreshed every tick)
    std::string error;
    // Per device: the most its processes may have now that the configuration no longer lists it
    // (kNoLimit: none; empty while configured). Never raised while the tenant is not configured.
    std::vector<uint64_t> ceiling;
    uid_t owner = 0;  // the ledger file's owner (unknown tenants are counted per uid)
    // A former ledger of this tenant, renamed away because another user owned it (or, for an
    // unknown tenant, replaced under its name), while processes still use it: what they hold
    // (charge, per device; only ever lowered) counts against the tenant's limit, and they may not
    // grow.
    struct Shadow {
      std::unique_ptr<Ledger> ledger;
      std::string fileName;  // "<name>.ledger.replaced.<n>"; empty: it has no name any more
      std::vector<uint64_t> charge;
      std::vector<uint64_t> initial;  // per device: the charge when attached (what bounds it)
    };
    std::vector<Shadow> shadows;
    // The ledger's flock was found held by another process: retried after one bounded wait per
    // tick (lockBusy), then reported as an error and retried without waiting (lockHeld).
    bool lockBusy = false, lockHeld = false;
    std::map<int, size_t> entryDevice;    // ledger entry -> the device it was seen naming
    // Per ledger device entry: what the last kHiddenTicks - 1 ticks found beyond the ledger, the
    // latest first (a charge must persist: hidden_memory.cpp charges the least of them and this
    // tick's).
    std::vector<std::array<uint64_t, kHiddenTicks - 1>> hiddenSeen;
    // Per ledger device entry: the most its processes' slots may hold (its published limit, or
    // what they held when the limit was lowered below it, going down as they free), and the
    // ticks in a row they were found above it (rows.cpp).
    std::vector<uint64_t> rowCeiling;
    std::vector<int> rowOver;
    std::vector<uint8_t> rowFirstLook;  // the ceiling was set by the first look, above the limit
    std::vector<uint8_t> rowSeen;       // the row was looked at (its ceiling may be kNoLimit's)
    std::vector<uint64_t> hidden;         // per device: what the broker charges now
    // Per device: what the device's own accounting showed the tenant's processes (its current
    // ledger's) holding at tick deviceHeldTick (hidden_memory.cpp); rows.cpp lets no row ceiling
    // stay above it.
    std::vector<uint64_t> deviceHeld;
    uint64_t deviceHeldTick = 0;
    std::vector<uint8_t> hiddenReported;  // per device: the charge exceeds context memory (warned)
    std::vector<uint8_t> hiddenPastLimitSaid;  // per device: "nothing to take down" said this episode
    std::vector<int> culpritRun;  // per device: consecutive judged ticks that found culprits
    std::vector<uint64_t> hiddenCharge;   // per ledger entry: the hidden part of the charge slot
    std::vector<uint64_t> leftBehind;     // per device: memory its exited processes left (left_behind.cpp)
    std::map<std::string, uint64_t> tamper;  // kind -> count (see TenantSnapshot::tamper)
    // busy_check.cpp: per device, the busy time the device counted for the tenant's processes
    // (ns, monotone; the scheduler bills the larger of it and what they metered), and the window
    // that compares the two.
    std::vector<uint64_t> deviceBusy;
    struct BusyWindow {
      uint64_t startNs = 0, metered = 0, device = 0;  // at the window's start (monotonic ns)
      int short_ = 0;         // consecutive windows that metered far less than the device counted
      bool flagged = false;   // warned and counted as tampering; cleared by a window that agrees
    };
    std::vector<BusyWindow> busyWindows;
    std::map<int32_t, uint64_t> keptPids; // slot pid -> times kept although its lock was free
    int links = 1;                        // hard links of the ledger file, last seen
    bool fileGone = false;  // an unknown tenant's file was removed while its processes ran (kept)
    // Under the broker's MPS (compute.cpp, mpsClientsLocked): per device, every live process of
    // the tenant there is a client of the MPS server, so the scheduler leaves the tenant to MPS.
    std::vector<uint8_t> mpsClientsOnly;
    // Its live processes that are not MPS clients: host pid -> (monotonic ns first seen so, warned).
    std::map<int, std::pair<uint64_t, bool>> notMpsClients;
  };

  // SIGKILL to host pid if it is still the process that started at startTime (hidden_memory.cpp:
  // through a pidfd, the start time checked after opening it, so a reused pid is never signalled).
  static bool killProcessIfStill(int pid, uint64_t startTime);
  // Whether host pid runs as the tenant's user: the ledger owner's uid, or (a tenant configured
  // with a gid, whose ledger its group shares) a member of that group (/proc/<pid>/status).
  static bool ofTenantsUser(const TenantState& t, int pid);

  // What the broker learned about a process the device reports (host pid).
  struct DeviceProcess {
    uint64_t startTime = 0;  // /proc/<pid>/stat: with the pid, the process's identity
    std::string tenant;      // "" until attributed: the tenant whose ledger it maps (sticky)
    int32_t nsPid = 0;       // its pid in its own (innermost) pid namespace: what its slot records
    uint64_t lastLook = 0;   // the tick it was last looked for in /proc (unattributed ones)
    uint64_t devices = 0;    // bit d: NVML lists it on device d (as of the last tick)
    // The ledger file it was attributed through, and whether that was one of the tenant's former
    // ledgers: what such a process hides is charged only up to what its former ledger was
    // charged when attached, and nothing once that former ledger is gone (hidden_memory.cpp).
    FileId file{};
    bool viaFormer = false;
    bool killTried = false;  // hidden_memory_response sent it SIGKILL (once per process)
  };

  struct Prepared {
    Config config;
    std::optional<gid_t> adminGid;
    std::map<std::string, std::vector<uint64_t>> configured;  // tenant -> per-device limit
    std::vector<uint64_t> unknown;  // per device: the unknown-tenant profile's limit
  };
  bool prepare(Prepared* out, std::string* err) const;
  bool loadStateFor(const Config& c, BrokerState* s, std::string* err) const;
  // The state file as it should be now (live limits o, the configuration's effective limits).
  BrokerState stateLocked(const Config& c, const Overrides& o,
                          const std::map<std::string, std::vector<uint64_t>>& effective) const;
  bool saveStateLocked(std::string* err);
  std::map<std::string, std::vector<uint64_t>> configuredLocked() const;  // config tenants' limits
  bool resolveAdmin(const Config& c, std::optional<gid_t>* gid, std::string* err) const;
  bool limitsFor(const Config& c, const MemorySpec& spec, std::vector<uint64_t>* out,
                 std::string* err) const;
  // unknown: the unknown-tenant profile's limit per device (its pool counts beside the tenants).
  bool checkEffective(const Config& c, const std::map<std::string, std::vector<uint64_t>>& limits,
                      const std::vector<uint64_t>& unknown, std::string* err) const;
  std::map<std::string, std::vector<uint64_t>> effectiveLimitsLocked(
      const Config& c, const std::map<std::string, std::vector<uint64_t>>& configured,
      const Overrides& o) const;
  uint64_t expectedLocked(const TenantState& t, size_t device, bool reclaim = true) const;
  // What the tenant's own ledger may hold: expected less its shadows' charge.
  uint64_t ledgerLimitLocked(const TenantState& t, size_t device) const;
  void supersedeLocked(TenantState* t, uid_t foundOwner);
  void watchShadowsLocked(TenantState* t);
  void attachShadowLocked(TenantState* t, std::unique_ptr<Ledger> l, const std::string& fileName);
  // The limits file of a ledger the broker holds, opened (a restarted broker's is kept) and
  // attached on first use; null (logged) when it cannot be written.
  LimitsFile* limitsOfLocked(Ledger* l, const std::string& tenant);
  // The most the processes of ledger entry e may hold (rows.cpp): its published limit (the
  // ledger's while none is published), or what they held when the limit was lowered below it.
  // False if the ledger cannot be read.
  bool entryAllowanceLocked(TenantState& t, int e, uint64_t* out);
  bool limitOfEntryLocked(TenantState& t, int e, uint64_t* out);  // the published limit, as above
  // Removes limits files whose ledger the broker no longer holds and no name in the directory
  // (named: the inodes found under the ledger directory's names) refers to.
  void collectLimitsFilesLocked(const std::set<uint64_t>& named);
  // A former ledger's limits file: every published entry gets what the former ledger is charged
  // on its device (0 for none).
  void shadowLimitsLocked(const TenantState::Shadow& sh);
  bool reattachLocked(TenantState* t, const std::string& file);
  // The ceiling of a tenant that is no longer configured, found at start: the lower of the last
  // configured limit (state file) and its ledger's.
  void ceilingFromRecordLocked(TenantState* t, bool required);
  bool keptFileLocked(const std::string& tenant, const std::string& file, const struct stat& st) const;
  void refuseUnknownLocked(const std::string& name, const std::string& file, const struct stat& st,
                           const std::string& why);
  void openLedgerLocked(TenantState* t);
  void ownLocked(TenantState* t);
  void noteError(TenantState* t, const std::string& err);
  void faultLocked(TenantState* t);
  // watchdog: a difference is someone else's change (logged as a warning), not the broker's.
  void applyLimitsLocked(TenantState* t, bool watchdog = false);
  bool writeHostLocked(std::string* err);
  uint32_t unknownAdoptedLocked() const;
  bool writeHostFor(const Config& c, const std::vector<uint64_t>& unknown, uint64_t generation,
                    std::string* err);
  void adoptLocked(const std::string& tenant, const std::string& fileName, const struct stat& st,
                   std::vector<std::string>* busy);
  void retireLocked(TenantState* t);
  TenantSnapshot tenantSnapshotLocked(TenantState* t);
  // The cap and priority in force: a live override, else the configuration's. An unknown
  // tenant's override only ever lowers its profile's.
  std::optional<int> threadsLocked(const TenantState& t) const;
  Priority priorityLocked(const TenantState& t) const;
  // busy: ledgers found flock-held, to wait for once (nullptr: the wait is over, report them).
  int tickLocked(bool scanDirectory, std::vector<std::string>* busy);
  void tamperLocked(TenantState* t, const std::string& kind);
  // A rewritten limit or UUID put back (applyLimitsLocked): with tamper_response kill, the
  // processes holding memory past the restored limit on those entries are killed.
  void takeBackLocked(TenantState* t, const std::set<int>& entries);
  void claimChargeLocked(TenantState* t);
  // hidden_memory.cpp: attributes the device's processes to tenants and charges hidden memory.
  // What a tenant's ledger slots show per entry (the broker's charge slot left out).
  struct ShownSums {
    const Ledger* ledger = nullptr;
    std::array<uint64_t, kLedgerMaxDevices> bytes{};
  };
  std::map<std::string, ShownSums> shownLocked();
  // judge: whether processes may be taken down from these figures (not in a tick's late pass,
  // whose device figures are a bounded flock wait older than the ledger's).
  void checkHiddenLocked(const std::vector<std::map<int, uint64_t>>& onDevice,
                         const std::map<std::string, ShownSums>& before,
                         const std::map<std::string, ShownSums>& after, bool judge = true);
  void attributeLocked(const std::vector<std::map<int, uint64_t>>& onDevice);
  // Usage counters that hold more than the limit allows (a process took bytes off its own slot's
  // counter around an allocation, then put them back): an honest row never grows while above its
  // limit. Found in kHiddenTicks ticks in a row: tampering, taken back as tamper_response says.
  void checkRowsLocked(const std::map<std::string, ShownSums>& before, const std::map<std::string, ShownSums>& after);
  // busy_check.cpp: the device's per-process busy time (NVML) added to each attributed process's
  // tenant, and each tenant's metering compared with it.
  void checkBusyLocked(const std::vector<std::map<int, uint64_t>>& busy);
  // outside_memory.cpp: what processes outside cushare (mapping no tenant's ledger) hold on each
  // device, for status, metrics and a warning; after attributeLocked.
  void checkOutsideLocked(const std::vector<std::map<int, uint64_t>>& onDevice, const std::vector<uint64_t>& deviceUsed);
  // elasticity.cpp: plain bursts reclaimed for guaranteed allocations that wait (one episode per
  // memory group at a time).
  void reclaimLocked(const std::vector<uint64_t>& deviceUsed);
  struct ReclaimEpisode {
    bool active = false;
    uint64_t startNs = 0;
    uint64_t need = 0;
    int quiet = 0;  // ticks in a row without a waiting allocation
    uint64_t needGoneNs = 0;  // the first such tick (the waiting allocations were granted, or gave up)
    std::string askers;       // who waits, for the log
  };
  std::vector<ReclaimEpisode> reclaim_;
  // elasticity.cpp: what bursts hold that the device would evict, into every tenant's limits file.
  void publishEvictableLocked(const std::vector<std::map<int, uint64_t>>& onDevice,
                              const std::vector<uint64_t>& deviceUsed);
  // left_behind.cpp: memory exited processes left on the device (exported VMM descriptors).
  void checkLeftBehindLocked(const std::vector<std::map<int, uint64_t>>& onDevice,
                             const std::vector<uint64_t>& deviceUsed, const std::vector<uint64_t>& deviceUsedHigh);
  struct LeftBehindDevice {
    std::map<int, std::pair<std::string, uint64_t>> last;  // host pid -> (tenant, bytes), last tick
    // tenant -> (slot index, slot pid) -> bytes its ledger slot showed on the device, last tick
    std::map<std::string, std::map<std::pair<int, int>, uint64_t>> lastSlots;
    std::map<std::string, uint64_t> lastListExit;  // tenant -> the tick NVML's list last lost one
    std::vector<uint64_t> recent;      // the device's unattributed memory, the last three ticks
    std::vector<uint64_t> recentHigh;  // the same from the larger of the two reads of the total
    bool haveBase = false;
    uint64_t base = 0;             // unattributed memory that no tenant left behind
    struct Pending {               // processes that exited in one tick, decided three ticks later
      // Exits NVML's process list showed: tenant ("" none) -> bytes the device showed they held.
      std::map<std::string, uint64_t> seen;
      // Exits only the ledgers showed (a process NVML never listed): tenant -> slot bytes + 1.
      std::map<std::string, uint64_t> unseen;
      int ticks = 0;
    };
    std::vector<Pending> pending;
    std::vector<std::pair<std::string, uint64_t>> charged;  // (tenant, bytes), oldest first
  };
  std::vector<LeftBehindDevice> leftBehind_;
  bool liveElsewhereLocked(const TenantState& t, int32_t slotPid) const;
  void scanLocked(std::vector<std::string>* busy);
  // compute.cpp
  struct ComputeState;
  // The thrashing guard (docs/memory-elasticity.md, "Thrashing"), per memory group: room is what
  // managed bursts can be resident in (the device's free memory and what it holds for no process:
  // elasticity.cpp, every tick; kNoLimit: unknown). While the managed bursters with work there
  // hold more than that together, they take turns (compute.cpp): one holder at a time, the others'
  // gates closed, thrash_quantum_ms each.
  struct ThrashGroup {
    uint64_t room = kNoLimit;
    bool on = false;
    std::vector<std::string> members;  // the bursters taking turns (with work lately), sorted
    std::string holder;                // whose turn it is (empty: nobody's yet)
    bool draining = false;             // the holder's gate is closed; its work in flight drains
    uint64_t turnStart = 0, drainStart = 0, calmSince = 0, onSince = 0;
    uint64_t busyMark = 0, busyAt = 0;  // the holder's busy time (all its devices here), when it last moved
    std::map<std::string, uint64_t> suspect;  // claimed work through a stall: its busy time then
    uint64_t turns = 0;                // turns given since the broker started (a counter)
    uint64_t turnsAtOn = 0;            // turns when this episode began
  };
  std::vector<ThrashGroup> thrash_;
  void thrashStepLocked(ComputeState& cs, uint64_t now);
  // Whether the tenant's gate on device d is closed by the thrashing guard (not its turn), and
  // whether it takes the guard's turns there at all.
  // *draining: it is the holder and its turn drains (gated, still in the scheduler's reckoning).
  bool thrashHeldLocked(const std::string& tenant, size_t d, bool* member, bool* draining) const;
  void computeSnapshotLocked(const std::string& tenant, size_t device, TenantDeviceSnapshot* out) const;
  // The hook for MPS (docs/compute.md): true when every live process of the tenant on the device
  // is a client of the broker's MPS server, whose caps MPS enforces; the scheduler then neither
  // gates nor paces the tenant there (metering goes on). A tenant with any other process there is
  // paced as without MPS.
  bool mpsUpOnLocked(size_t device) const;  // the MPS daemon of the device answers
  bool computeUnderMpsLocked(const TenantState& t, size_t device) const;
  // Every tick, after reaping: which tenants have only MPS clients on each device (the server's
  // client lists from the last health check against the tenants' live processes: their ledger
  // slots' holders and what NVML lists), and the warning for a process that is not a client.
  void mpsClientsLocked();

  const std::string configPath_;
  const std::vector<DeviceInfo> devices_;
  const std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  double startedUnix_ = 0;

  mutable std::mutex mu_;
  std::shared_ptr<PodLabeler> podLabeler_;  // under mu_; null: pod labels off
  Config config_;
  std::optional<gid_t> adminGid_;
  std::string ledgerDir_;  // fixed at start: moving ledgers under running tenants is not possible
  uint64_t generation_ = 0;
  Overrides overrides_;
  // Live compute overrides (set-limit --threads/--priority), kept in the state file.
  std::map<std::string, int> threadOverrides_;
  std::map<std::string, Priority> priorityOverrides_;
  std::map<std::string, std::unique_ptr<TenantState>> tenants_;  // by name
  std::vector<uint64_t> unknownLimits_;                          // per device
  std::map<std::string, std::string> adoptErrors_;  // file -> why it could not be adopted (logged once)
  // Ledger files of unknown tenants beyond the caps, or renamed files the broker does not know:
  // file name -> inode, forgotten when the file goes.
  std::map<std::string, uint64_t> refused_;
  uint64_t unknownRefused_ = 0;   // counter: unknown-tenant ledgers refused (caps)
  // Lines other users can cause at will (log_limit.h): refused ledger files, GPU processes that
  // are no tenant's. 20 at once, then one every 6 s each.
  LogLimit refusedLog_{20, std::chrono::milliseconds(6000)};
  LogLimit strangersLog_{20, std::chrono::milliseconds(6000)};
  // Lines a tenant causes by rewriting its ledger (a limit or device UUID put back every tick):
  // the same budget; tamper metrics count every one.
  LogLimit tamperLog_{20, std::chrono::milliseconds(6000)};
  BrokerState state_;             // as last written to the state file
  bool stateDirty_ = false;       // the state file is behind (a shadow came or went)
  bool unknownFull_ = false;      // the host segment offers new unknown tenants nothing (caps reached)
  std::string cuptiRefused_;      // why compute.cupti_library was last not offered (said once per reason)
  std::string metricsAddress_;
  BrokerSnapshot::MigLayout migLayout_;  // guarded by mu_
  // Per device: its accounting could not be read this tick (a MIG device gone), and why (last said).
  std::vector<bool> deviceUnread_;
  bool unreadLocked(size_t d) const { return d < deviceUnread_.size() && deviceUnread_[d]; }
  // Device d shares its memory with other MIG devices (compute instances of one GPU instance).
  bool sharedMemoryLocked(size_t d) const {
    for (size_t x = 0; x < devices_.size(); ++x)
      if (x != d && devices_[x].group(x) == devices_[d].group(d)) return true;
    return false;
  }
  std::vector<std::string> unreadError_ = std::vector<std::string>(kLedgerMaxDevices);
  MpsSnapshot mps_;
  uint64_t reaped_ = 0;
  uint64_t reloadsRefused_ = 0;
  std::map<int, DeviceProcess> deviceProcesses_;  // host pid -> (the device's processes only)
  struct OutsideDevice {
    bool read = false;         // the device's accounting was read at the last tick
    uint64_t deviceUsed = 0;   // the device's used memory, as it reports it
    uint64_t bytes = 0;        // held by processes outside cushare
    std::vector<int> pids;     // those processes, largest first
    int ticks = 0;             // consecutive ticks with some (warned at kOutsideTicks)
    bool warned = false;
  };
  std::vector<OutsideDevice> outside_;  // per device (outside_memory.cpp)
  // Per device: every process's busy time as NVML's per-process utilization counted it since the
  // broker started, cushare's processes or not (busy_check.cpp), ns.
  std::vector<uint64_t> deviceBusyNs_;
  uint64_t ticks_ = 0;
  std::string deviceError_;  // the device's per-process accounting could not be read (logged once)
  std::string busyError_;    // the device's per-process busy time could not be read (logged once)
  ProcessBusyReader busyReader_;  // used by tick() only (the reaper's thread), outside mu_
  std::shared_ptr<ComputeState> compute_;  // compute.cpp; created by the first computeTick
  std::unique_ptr<ProbeScheduler> probes_;  // probes.cpp; created by the first computeTick
};

}  // namespace cushare::broker
