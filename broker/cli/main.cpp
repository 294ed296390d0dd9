// cushare: the command-line client of cushare-broker's control socket. Global options come before
// the verb; each verb sends one request and prints the reply (see commands.h for exit codes).
#include <pwd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "commands.h"
#include "cushare/parse.h"
#include "rpc/codec.h"

namespace {

using cushare::cli::Globals;

constexpr const char* kDefaultSocket = "/run/cushare/broker.sock";

void printHelp() {
  std::printf(
      "usage: cushare [--socket PATH] [--broker-user USER] [--json] VERB [ARGS...]\n"
      "\n"
      "Asks cushare-broker, over its control socket, about tenants and their GPU memory, and\n"
      "starts processes as tenants.\n"
      "\n"
      "verbs:\n");
  cushare::cli::printVerbs(stdout);
  std::printf(
      "\n"
      "options:\n"
      "  --socket PATH  the broker's control socket (default: $CUSHARE_SOCKET, else %s)\n"
      "  --broker-user USER\n"
      "                 also trust a broker running as USER (name or uid; default:\n"
      "                 $CUSHARE_BROKER_USER); root and you are always trusted\n"
      "  --json         print the reply, or {\"error\": ...}, as JSON on stdout (also after\n"
      "                 the verb)\n"
      "  --help         this text; VERB --help: that verb's usage\n"
      "  --version      the client's version and protocol\n"
      "\n"
      "exit status: 0 success, 1 the broker refused or could not be reached, 2 bad usage;\n"
      "run: the command's own status, 127 when it cannot be started\n",
      kDefaultSocket);
}

// A user name or a numeric uid, as --broker-user takes it.
bool resolveUser(const std::string& user, uint32_t* uid) {
  int64_t n = 0;
  std::string ignored;
  if (cushare::parseInt(user, 0, UINT32_MAX - 1, &n, &ignored)) {
    *uid = static_cast<uint32_t>(n);
    return true;
  }
  const passwd* pw = ::getpwnam(user.c_str());
  if (!pw) return false;
  *uid = pw->pw_uid;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Globals g;
  const char* envSocket = std::getenv("CUSHARE_SOCKET");
  g.socket = envSocket && *envSocket ? envSocket : kDefaultSocket;
  auto usage = [&](const std::string& why) {
    return cushare::cli::report(g, cushare::cli::kExitUsage, why + " (see 'cushare --help')");
  };

  std::string brokerUser;
  if (const char* env = std::getenv("CUSHARE_BROKER_USER")) brokerUser = env;
  int i = 1;
  for (; i < argc && argv[i][0] == '-'; ++i) {
    const std::string arg = argv[i];
    if (arg == "--json") {
      g.json = true;
    } else if (arg == "--help" || arg == "-h") {
      printHelp();
      return 0;
    } else if (arg == "--version") {
      std::printf("cushare %s (control protocol %u)\n", CUSHARE_VERSION,
                  cushare::rpc::kProtocolVersion);
      return 0;
    } else if (arg == "--socket" || arg.starts_with("--socket=")) {
      g.socket = arg == "--socket" ? (i + 1 < argc ? argv[++i] : "") : arg.substr(9);
      if (g.socket.empty()) return usage("--socket needs a path");
    } else if (arg == "--broker-user" || arg.starts_with("--broker-user=")) {
      brokerUser = arg == "--broker-user" ? (i + 1 < argc ? argv[++i] : "") : arg.substr(14);
      if (brokerUser.empty()) return usage("--broker-user needs a user name or uid");
    } else {
      return usage("unknown option '" + cushare::printable(arg, 40) + "' before the verb");
    }
  }
  if (!brokerUser.empty()) {
    uint32_t uid = 0;
    if (!resolveUser(brokerUser, &uid))
      return usage("--broker-user / CUSHARE_BROKER_USER: no user '" +
                   cushare::printable(brokerUser, 40) + "' on this host");
    g.brokerUids.push_back(uid);
  }
  if (i == argc) return usage("missing a verb");
  return cushare::cli::runVerb(g, argv[i], std::vector<std::string>(argv + i + 1, argv + argc));
}
