// `cushare top`'s frame from two samples of the tenants (broker/cli/top.cpp): rates over the
// interval, memory as of the second sample, a broker restart between samples, a tenant that
// appeared meanwhile, busiest first.
#include <gtest/gtest.h>

#include "cli/top.h"

namespace cushare::cli {
namespace {

rpc::TenantDevice* addDevice(rpc::Tenant* t, int device, uint64_t used, uint64_t busyNs, uint64_t throttledNs,
                             uint64_t denied) {
  rpc::TenantDevice* d = t->add_devices();
  d->set_device(device);
  d->set_uuid("GPU-" + std::to_string(device));
  d->set_used_bytes(used);
  d->set_busy_ns(busyNs);
  d->set_throttled_ns(throttledNs);
  d->set_denied(denied);
  return d;
}

rpc::TenantsReply sample(uint64_t alphaBusy, uint64_t betaBusy, bool withGamma) {
  rpc::TenantsReply r;
  rpc::Device* dev = r.add_devices();
  dev->set_index(0);
  dev->set_uuid("GPU-0");
  dev->set_capacity_bytes(80ull << 30);
  dev->set_used_bytes(3ull << 30);
  dev->set_device_used_bytes(4ull << 30);
  dev->set_outside_bytes(1ull << 30);
  rpc::Tenant* a = r.add_tenants();
  a->set_name("alpha");
  a->set_priority("high");
  a->set_processes(2);
  a->set_thread_percentage(50);
  rpc::TenantDevice* ad = addDevice(a, 0, 2ull << 30, alphaBusy, alphaBusy / 10, alphaBusy / 1'000'000);
  ad->set_limit_bytes(4ull << 30);
  rpc::Tenant* b = r.add_tenants();
  b->set_name("beta");
  b->set_priority("normal");
  addDevice(b, 0, 1ull << 30, betaBusy, 0, 0);
  if (withGamma) {
    rpc::Tenant* g = r.add_tenants();
    g->set_name("gamma");
    g->set_priority("low");
    addDevice(g, 0, 0, 5'000'000'000, 0, 0);
  }
  rpc::Tenant* broken = r.add_tenants();
  broken->set_name("delta");
  broken->set_error("ledger damaged");
  return r;
}

TEST(Top, RatesOverTheIntervalAndMemoryAsOfTheSecondSample) {
  // Over 2 s: alpha ran 1.2 s (60 %), waited 0.12 s, had 1200 refusals; beta ran 0.2 s.
  const rpc::TopFrame f = topFrame(sample(1'000'000'000, 0, false), sample(2'200'000'000, 200'000'000, true), 2.0, 1e9);
  EXPECT_EQ(f.interval_seconds(), 2.0);
  EXPECT_EQ(f.time(), 1e9);
  ASSERT_EQ(f.devices_size(), 1);
  const rpc::TopDevice& d = f.devices(0);
  EXPECT_EQ(d.uuid(), "GPU-0");
  EXPECT_EQ(d.device_used_bytes(), 4ull << 30);
  EXPECT_EQ(d.outside_bytes(), 1ull << 30);
  ASSERT_EQ(d.tenants_size(), 3);
  const rpc::TopTenant& a = d.tenants(0);
  EXPECT_EQ(a.tenant(), "alpha") << "busiest first";
  EXPECT_DOUBLE_EQ(a.busy(), 0.6);
  EXPECT_DOUBLE_EQ(a.throttled(), 0.06);
  EXPECT_DOUBLE_EQ(a.denied_per_second(), 600);
  EXPECT_EQ(a.used_bytes(), 2ull << 30);
  EXPECT_EQ(a.limit_bytes(), 4ull << 30);
  EXPECT_EQ(a.thread_percentage(), 50);
  EXPECT_EQ(a.priority(), "high");
  EXPECT_EQ(a.processes(), 2u);
  EXPECT_EQ(d.tenants(1).tenant(), "beta");
  EXPECT_DOUBLE_EQ(d.tenants(1).busy(), 0.1);
  EXPECT_FALSE(d.tenants(1).has_limit_bytes());
  // gamma appeared between the samples: its counters are since the broker started, not the interval.
  EXPECT_EQ(d.tenants(2).tenant(), "gamma");
  EXPECT_EQ(d.tenants(2).busy(), 0);
  EXPECT_DOUBLE_EQ(d.busy(), 0.7);
  ASSERT_EQ(f.errors_size(), 1);
  EXPECT_EQ(f.errors(0), "tenant delta: ledger damaged");
}

TEST(Top, ACounterThatWentBackCountsFromZeroAndBusyNeverPassesOne) {
  // The broker restarted between the samples (counters from 0 again): 0.5 s of 1 s.
  rpc::TopFrame f = topFrame(sample(9'000'000'000, 0, false), sample(500'000'000, 0, false), 1.0, 0);
  EXPECT_DOUBLE_EQ(f.devices(0).tenants(0).busy(), 0.5);
  // Sampling jitter: more busy time than wall time reads as the whole interval.
  f = topFrame(sample(0, 0, false), sample(1'500'000'000, 0, false), 1.0, 0);
  EXPECT_DOUBLE_EQ(f.devices(0).tenants(0).busy(), 1.0);
}

}  // namespace
}  // namespace cushare::cli
