// `cushare top`: a live view of each device and the tenants on it (memory against the limit, the
// share of the device's time each got, time its launches waited, refusals, its priority and cap,
// the probes' measured share with its confidence, memory outside cushare), refreshed every
// interval; --once prints one frame, --json one JSON object per frame.
#pragma once

#include "control.pb.h"

namespace cushare::cli {

// One frame from two samples `seconds` apart (the second taken at Unix time `now`): memory as of
// the second, rates (busy, throttled, denied) over the interval.
rpc::TopFrame topFrame(const rpc::TenantsReply& before, const rpc::TenantsReply& after, double seconds, double now);

// The frame for people: a block per device, a row per tenant (output.cpp).
void printTopFrame(const rpc::TopFrame& f);

}  // namespace cushare::cli
