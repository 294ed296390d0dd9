// Running part of a test as another user from any checkout location.
//
// The suite runs as root; docs/security.md deploys each tenant on a uid of its own, so tests run
// tenant processes as uid 1000 and up. A checkout may lie in a directory only its owner can enter
// (mkdtemp and many home directories make them 0700): a process of another uid then cannot reach
// the build tree's programs or libraries (the dynamic loader answers "cannot open shared object
// file"). A UserStage is a fresh directory under /tmp that every user can enter and read; the test
// copies into it what such a child runs (its program, simgpu's driver libraries, the shim) and
// starts the child from there. What the child shares with the test at run time (the simulated
// host's state, MPS pipe directories, ledgers) lies outside the checkout (tests/CMakeLists.txt puts
// the test-state root under /tmp); UserStage::reachable says whether a uid can open a path, so a
// test can refuse to run with a clear reason instead of failing in the child.
//
// Header-only, test code: copies are plain std::filesystem copies; the stage goes with the object.
#pragma once

#include <sys/stat.h>
#include <sys/wait.h>
#include <grp.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <system_error>

namespace cushare::test {

class UserStage {
 public:
  UserStage() {
    char tmpl[] = "/tmp/cushare-user-stage-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) throw std::runtime_error("UserStage: mkdtemp failed");
    dir_ = tmpl;
    ::chmod(dir_.c_str(), 0755);  // mkdtemp makes it 0700
  }
  ~UserStage() {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  UserStage(const UserStage&) = delete;
  UserStage& operator=(const UserStage&) = delete;

  const std::string& dir() const { return dir_; }

  // Copies a file (links followed) or a directory tree (links kept as links) into the stage as
  // name, readable by every user (and searchable, for directories and programs); its staged path.
  std::string copy(const std::string& from, const std::string& name) {
    namespace fs = std::filesystem;
    const fs::path to = fs::path(dir_) / name;
    fs::create_directories(to.parent_path());
    ::chmod(to.parent_path().c_str(), 0755);
    if (fs::is_directory(from))
      fs::copy(from, to, fs::copy_options::recursive | fs::copy_options::copy_symlinks);
    else
      fs::copy_file(from, to, fs::copy_options::overwrite_existing);
    openToAll(to);
    if (fs::is_directory(to))
      for (const auto& e : fs::recursive_directory_iterator(to)) openToAll(e.path());
    return to.string();
  }

  // Whether uid can open path for reading (every directory on the way searchable): asked of the
  // kernel by a child that becomes uid, so groups, ACLs and mount options all count.
  static bool reachable(const std::string& path, uid_t uid) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      if (::setgroups(0, nullptr) != 0 || ::setgid(uid) != 0 || ::setuid(uid) != 0) _exit(2);
      _exit(::access(path.c_str(), R_OK) == 0 ? 0 : 1);
    }
    int status = 0;
    return pid > 0 && ::waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }

 private:
  static void openToAll(const std::filesystem::path& p) {
    struct stat st;
    if (::lstat(p.c_str(), &st) != 0 || S_ISLNK(st.st_mode)) return;
    const bool searchable = S_ISDIR(st.st_mode) || (st.st_mode & S_IXUSR) != 0;
    ::chmod(p.c_str(), (st.st_mode & 07777) | 0444 | (searchable ? 0111 : 0));
  }

  std::string dir_;
};

}  // namespace cushare::test
