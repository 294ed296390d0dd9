// Writing a file that readers must see whole or not at all (the broker's mps.conf and CDI spec),
// and making the directories such files live in.
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

// mkdir -p: each missing directory on the way to dir with mode 0755, dir itself (when missing)
// with `mode`; existing ones are left as they are. False with *err ("cannot create <what><dir>:
// <reason>", naming the component that failed, or "<what><dir> is not a directory"). `what`
// names the directory's role for the message ("ledger directory "), or is empty.
bool makeDirectories(const std::string& dir, mode_t mode, const std::string& what, std::string* err);
// The directories above path (mode 0755), the last component left to the caller.
bool makeParentDirectories(const std::string& path, std::string* err);

}  // namespace cushare
