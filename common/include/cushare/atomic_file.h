// Writing a file that readers must see whole or not at all (the broker's mps.conf and CDI spec).
#pragma once

#include <sys/types.h>

#include <string>

namespace cushare {

// Writes text to a new temporary file made from tmpTemplate (a path in path's directory ending in
// "XXXXXX": unpredictable, since the directory may be writable by others; readers that scan the
// directory should not match it), with mode, fsyncs it, renames it over path and fsyncs the
// directory, so a reader sees the old file or the new one and a crash keeps one of them. False
// with *err ("cannot write <path>: <reason>"); no temporary is left behind.
bool writeFileAtomically(const std::string& path, std::string tmpTemplate, const std::string& text, mode_t mode,
                         std::string* err);

}  // namespace cushare
