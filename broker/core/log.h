// The broker's logging: spdlog's default logger, which main() points at stderr (one line an event,
// systemd's journal adds the time). Levels: error (something an operator must fix), warn (the
// broker corrected something), info (what changed), debug.
#pragma once

#include <spdlog/spdlog.h>

#define CUSHARE_BLOG(level, ...) ::spdlog::level(__VA_ARGS__)
