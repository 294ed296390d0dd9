// CUPTI activity records as the busy-time source, where CUPTI starts (cupti_source.cpp).
#pragma once

#include <cstddef>

#include "policy/busy_source.h"

namespace cushare::shim {

// Loads `library` (null: libcupti.so.13 by name, standalone; a path: the broker's, loaded only
// if it is a regular file of root or brokerUid that group and others cannot write, and no other
// libcupti.so.13 is already in the process), registers the buffer callbacks and enables kernel,
// memcpy and memset records; the records' busy time goes to sink per device ordinal (those
// `metered` accepts). False, with the reason in why, when any step fails: nothing stays enabled
// and the caller meters with events.
bool startCupti(const char* library, uint32_t brokerUid, int devices, ActivityBusy::Sink sink,
                ActivityBusy::Metered metered, char* why, size_t whySize) noexcept;
// Whether startCupti succeeded (then busy time comes from CUPTI, not from the markers).
bool cuptiActive() noexcept;
// Asks CUPTI for the completed buffers (forced: also those with records not complete yet). The
// pacer thread calls it, never the launch path.
void flushCupti(bool forced) noexcept;
ActivityBusy& activityBusy() noexcept;
// In a forked child: CUPTI is not used (its threads and buffers are the parent's).
void cuptiForgetAfterFork() noexcept;

}  // namespace cushare::shim
