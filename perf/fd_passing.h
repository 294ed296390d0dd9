// Passing one file descriptor over a Unix socket (SCM_RIGHTS), for the probes and tests that hand
// an exported VMM descriptor to a process that never imports it (perf/vmm_export_probe.cpp,
// tests/broker). Header-only; not part of the product.
#pragma once

#include <sys/socket.h>

#include <cstring>

namespace cushare::fdpass {

// One byte of data and room for one descriptor: the message both directions use.
struct OneFd {
  char byte = 'x';
  iovec iov{&byte, 1};
  alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int))] = {};
  msghdr m{};
  OneFd() {
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    m.msg_control = ctl;
    m.msg_controllen = sizeof ctl;
  }
  OneFd(const OneFd&) = delete;
  OneFd& operator=(const OneFd&) = delete;
};

// Sends fd with one byte of data; 0 on success, -1 otherwise.
inline int sendFd(int sock, int fd) {
  OneFd o;
  cmsghdr* c = CMSG_FIRSTHDR(&o.m);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof fd);
  return sendmsg(sock, &o.m, MSG_NOSIGNAL) == 1 ? 0 : -1;
}

// Receives one descriptor (close-on-exec); -1 on failure.
inline int recvFd(int sock) {
  OneFd o;
  if (recvmsg(sock, &o.m, MSG_CMSG_CLOEXEC) != 1) return -1;
  cmsghdr* c = CMSG_FIRSTHDR(&o.m);
  if (c == nullptr || c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) return -1;
  int fd;
  std::memcpy(&fd, CMSG_DATA(c), sizeof fd);
  return fd;
}

}  // namespace cushare::fdpass
