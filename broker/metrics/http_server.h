// A minimal HTTP/1.x server for the metrics endpoint: GET /metrics returns what the render
// callback gives. It is not a general web server: one request per connection, no keep-alive, no
// request bodies, headers read only for their size.
//
// Behaviour (docs/operations.md):
// - GET /metrics: 200, `Content-Type: text/plain; version=0.0.4; charset=utf-8`. GET /: a line
//   pointing at /metrics. Other paths: 404. HEAD is answered like GET without the body; other
//   methods: 405 with `Allow: GET, HEAD`. A malformed request line: 400; an HTTP version other
//   than 1.0 and 1.1: 505; a request head (request line + headers) over 8 KiB: 431; render
//   throwing a std::exception: 500 with its message. A query string is ignored. Every response
//   carries Content-Length and `Connection: close`.
// - A client that has not sent its whole request head within 5 s is dropped without a response;
//   a client that takes no part of the response for 5 s is dropped too.
// - After the response the server half-closes and discards what the client still sends until it
//   closes, for at most 1 s: closing with unread input would send a TCP reset, which can destroy
//   the response before the client reads it.
// - Fair per client and per connection: at most 64 connections at a time, at most 16 of one IP
//   address. A newcomer's request is read as soon as it is accepted (an HTTP client sends it with
//   the connection), so it is answered at once. To make room for a newcomer, a connection that is
//   still waiting for its request head is closed without a response: the oldest of the
//   newcomer's own address when that address holds 16, else the oldest of the address holding the
//   most. So a client that opens connections and sends nothing or dribbles (slow loris), or opens
//   them as fast as it can, only displaces its own, and other clients wait only for the
//   connections queued before theirs. A newcomer for whom no room can be made (every connection
//   of its address is being answered) gets 503 with Retry-After: 1. While 64 are open and all are
//   being answered the server stops accepting: further clients wait in the kernel's listen backlog
//   of 4096 (capped by net.core.somaxconn). One wake-up accepts at most 16 connections, then the open ones get their turn; each
//   connection gets one request and at most one render.
//
// Threading: one thread of its own runs poll() over the listening socket, the connections and an
// eventfd that stop() signals. Every socket is non-blocking, so a slow or silent client never
// holds up another. render is called on that thread, once per GET or HEAD of /metrics; it must
// be safe to call from there. The thread blocks every signal, so the owner's signal handling
// (sigwait, signalfd) is not disturbed; writes use MSG_NOSIGNAL, so a closed peer never raises
// SIGPIPE.
//
// start(), address() and stop() are called by the owner, from one thread.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <thread>

namespace cushare::broker {

class MetricsServer {
 public:
  MetricsServer() = default;
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // Binds host:port and starts serving. host: an IPv4 address, an IPv6 address without brackets
  // or a name (resolved with getaddrinfo; the first address that can be bound is used). Port 0
  // picks a free port (see address()). On failure returns false and sets *err to one line, e.g.
  // "cannot listen on 127.0.0.1:9464: Address already in use". Fails if already started.
  bool start(const std::string& host, uint16_t port, std::function<std::string()> render,
             std::string* err);

  // The bound address, "127.0.0.1:45123" or "[::1]:9464"; empty when not started.
  std::string address() const;

  // Closes every connection and the listening socket and joins the thread. Idempotent; also run
  // by the destructor. Returns within a poll wake-up, whatever the clients do.
  void stop();

 private:
  void closeSockets();

  int listenFd_ = -1;
  int wakeFd_ = -1;  // eventfd: written by stop(), polled by the thread
  std::string address_;
  std::thread thread_;
};

}  // namespace cushare::broker
