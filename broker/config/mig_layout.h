// The entry parser of MIG layouts (mig_layout.cpp), for the mig: block of the configuration.
#pragma once

#include <string>
#include <vector>

#include "config.h"
#include "yaml_tree.h"

namespace cushare::broker {

// A list of mig-parted entries at `path` of `file`. False with one error line.
bool parseMigLayoutEntries(const yaml::Node& list, const std::string& file, const std::string& path,
                           std::vector<MigLayoutEntry>* out, std::string* error);

}  // namespace cushare::broker
