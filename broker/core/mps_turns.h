// Whether MPS clients take the weighted turns on a device (docs/compute.md, "Weights under MPS"),
// decided once per scheduler step. Kept apart from the scheduler so that its hold can be tested
// step by step (tests/unit/mps_turns_test.cpp).
#pragma once

#include <cstdint>

namespace cushare::broker {

// Turns come into force at once when their reasons hold (want). What rules them out (barred: the
// setting off, a client with work left out, clients whose percentages overlap in part) ends them
// at once. What only flickers (a contender's work, its process count) ends them once the reasons
// have been gone for `hold` ns; meanwhile only the clients already in turns keep their place, so
// a flickering contender does not gate and ungate the clients every step.
class MpsTurnsHold {
 public:
  // One step at monotonic time now (ns); whether turns are in force after it.
  bool step(bool want, bool barred, uint64_t now, uint64_t hold) {
    wanted_ = want && !barred;
    if (wanted_) {
      on_ = true;
      goneSince_ = 0;
    } else if (barred) {
      on_ = false;
      goneSince_ = 0;
    } else if (on_) {
      if (goneSince_ == 0) goneSince_ = now;
      if (now - goneSince_ >= hold) {
        on_ = false;
        goneSince_ = 0;
      }
    }
    return on_;
  }
  // Whether a member takes the turns at this step: a client that would contend, taken while the
  // reasons hold, kept during the hold only if it was in turns at the last step.
  bool member(bool client, bool contends, bool wasIn) const {
    return on_ && client && contends && (wanted_ || wasIn);
  }

 private:
  bool on_ = false;
  bool wanted_ = false;
  uint64_t goneSince_ = 0;  // since when the reasons are gone (0: they hold)
};

}  // namespace cushare::broker
