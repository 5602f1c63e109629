// The torchrun environment and the TCP exchange of the NCCL unique id (the header has the why).
#include "octet/dist/bootstrap.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "octet/core/error.h"

namespace octet::dist {
namespace {

using Clock = std::chrono::steady_clock;

/// Precedes the id on the wire, so a rank that reached some other service on the port says so
/// instead of starting NCCL with garbage.
constexpr char kMagic[8] = {'o', 'c', 't', 'e', 't', 'i', 'd', '1'};
/// How often a rank retries a connection that rank 0 is not accepting yet.
constexpr std::chrono::milliseconds kRetryInterval{100};

/// The integer value of variable `name`, or nullopt when unset; throws when it is not one.
std::optional<int> integer_variable(const char* name) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return std::nullopt;
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  OCTET_CHECK(*end == '\0' && value >= 0 && value <= INT32_MAX, "the environment variable ", name,
              " must be a non-negative integer, got '", text, "'");
  return static_cast<int>(value);
}

int milliseconds_left(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return static_cast<int>(std::max<int64_t>(0, left.count()));
}

/// Sends or receives exactly `bytes` on `fd` before `deadline`; false on timeout or a closed peer.
bool transfer(int fd, char* data, size_t bytes, bool sending, Clock::time_point deadline) {
  size_t done = 0;
  while (done < bytes) {
    pollfd p{fd, static_cast<short>(sending ? POLLOUT : POLLIN), 0};
    if (::poll(&p, 1, milliseconds_left(deadline)) <= 0) return false;
    const ssize_t n = sending ? ::send(fd, data + done, bytes - done, MSG_NOSIGNAL)
                              : ::recv(fd, data + done, bytes - done, 0);
    if (n <= 0) {
      if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      return false;
    }
    done += static_cast<size_t>(n);
  }
  return true;
}

/// Closes a file descriptor when it leaves scope.
struct Closer {
  int fd;
  ~Closer() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

std::optional<TorchrunEnvironment> torchrun_environment() {
  const std::optional<int> world = integer_variable("WORLD_SIZE");
  if (!world) return std::nullopt;
  TorchrunEnvironment env;
  env.world_size = *world;
  OCTET_CHECK(env.world_size >= 1, "WORLD_SIZE must be at least 1, got ", env.world_size);
  const std::optional<int> rank = integer_variable("RANK");
  OCTET_CHECK(rank.has_value(), "WORLD_SIZE is set but RANK is not: launch with torchrun, or set "
              "RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for every process");
  env.rank = *rank;
  OCTET_CHECK(env.rank < env.world_size, "RANK ", env.rank, " is not a rank of WORLD_SIZE ",
              env.world_size);
  env.local_rank = integer_variable("LOCAL_RANK").value_or(0);
  if (env.world_size > 1) {
    const char* addr = std::getenv("MASTER_ADDR");
    OCTET_CHECK(addr != nullptr && *addr != '\0',
                "MASTER_ADDR is not set: the address of rank 0's host, where it listens on "
                "MASTER_PORT for the other ranks");
    env.master_addr = addr;
    const std::optional<int> port = integer_variable("MASTER_PORT");
    OCTET_CHECK(port.has_value() && *port >= 1 && *port <= 65535,
                "MASTER_PORT must be a TCP port (1..65535) that rank 0 can listen on");
    env.master_port = *port;
  }
  return env;
}

int launcher_local_rank() {
  for (const char* name :
       {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"})
    if (const std::optional<int> value = integer_variable(name)) return *value;
  return 0;
}

UniqueIdServer::UniqueIdServer(int port) {
  socket_ = ::socket(AF_INET6, SOCK_STREAM, 0);
  const bool ipv6 = socket_ >= 0;
  if (!ipv6) socket_ = ::socket(AF_INET, SOCK_STREAM, 0);
  OCTET_CHECK(socket_ >= 0, "cannot open a TCP socket: ", std::strerror(errno));
  const int yes = 1, no = 0;
  ::setsockopt(socket_, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  int bound = -1;
  if (ipv6) {
    ::setsockopt(socket_, IPPROTO_IPV6, IPV6_V6ONLY, &no, sizeof no);  // IPv4 clients too
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_addr = in6addr_any;
    a.sin6_port = htons(static_cast<uint16_t>(port));
    bound = ::bind(socket_, reinterpret_cast<sockaddr*>(&a), sizeof a);
  } else {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(static_cast<uint16_t>(port));
    bound = ::bind(socket_, reinterpret_cast<sockaddr*>(&a), sizeof a);
  }
  if (bound != 0 || ::listen(socket_, SOMAXCONN) != 0) {
    const std::string why = std::strerror(errno);
    ::close(socket_);
    OCTET_ERROR("rank 0 cannot listen on port ", port, " (MASTER_PORT): ", why,
                "; pick a free port");
  }
  sockaddr_storage name{};
  socklen_t length = sizeof name;
  ::getsockname(socket_, reinterpret_cast<sockaddr*>(&name), &length);
  port_ = ntohs(name.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&name)->sin6_port
                                           : reinterpret_cast<sockaddr_in*>(&name)->sin_port);
}

UniqueIdServer::~UniqueIdServer() {
  if (socket_ >= 0) ::close(socket_);
}

void UniqueIdServer::serve(const UniqueIdBytes& id, int clients,
                           std::chrono::milliseconds deadline) {
  const Clock::time_point until = Clock::now() + deadline;
  char message[sizeof kMagic + kUniqueIdBytes];
  std::memcpy(message, kMagic, sizeof kMagic);
  std::memcpy(message + sizeof kMagic, id.data(), kUniqueIdBytes);
  for (int served = 0; served < clients;) {
    pollfd p{socket_, POLLIN, 0};
    OCTET_CHECK(::poll(&p, 1, milliseconds_left(until)) > 0, "rank 0 handed the NCCL id to ",
                served, " of ", clients, " ranks within ", deadline.count() / 1000,
                " s: the others did not connect to MASTER_ADDR:MASTER_PORT (port ", port_,
                "); check that every rank runs and can reach rank 0's host");
    const int fd = ::accept(socket_, nullptr, nullptr);
    if (fd < 0) continue;
    Closer close{fd};
    if (transfer(fd, message, sizeof message, /*sending=*/true, until)) ++served;
  }
}

UniqueIdBytes fetch_unique_id(const std::string& host, int port,
                              std::chrono::milliseconds deadline) {
  const Clock::time_point until = Clock::now() + deadline;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  std::string last_error = "no attempt";
  while (true) {
    addrinfo* found = nullptr;
    const int resolved = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
    if (resolved != 0) {
      last_error = std::string("cannot resolve ") + host + ": " + ::gai_strerror(resolved);
    } else {
      for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
        Closer fd{::socket(a->ai_family, a->ai_socktype, a->ai_protocol)};
        if (fd.fd < 0) continue;
        if (::connect(fd.fd, a->ai_addr, a->ai_addrlen) != 0) {
          last_error = std::strerror(errno);
          continue;
        }
        char message[sizeof kMagic + kUniqueIdBytes];
        if (!transfer(fd.fd, message, sizeof message, /*sending=*/false, until)) {
          last_error = "the connection closed before the id arrived";
          continue;
        }
        ::freeaddrinfo(found);
        OCTET_CHECK(std::memcmp(message, kMagic, sizeof kMagic) == 0, host, ":", port,
                    " is not an octet rank 0 (MASTER_ADDR:MASTER_PORT point at another service)");
        UniqueIdBytes id;
        std::memcpy(id.data(), message + sizeof kMagic, kUniqueIdBytes);
        return id;
      }
    }
    if (found != nullptr) ::freeaddrinfo(found);
    OCTET_CHECK(Clock::now() + kRetryInterval < until, "no NCCL id from rank 0 at ", host, ":",
                port, " (MASTER_ADDR:MASTER_PORT) within ", deadline.count() / 1000,
                " s: ", last_error);
    std::this_thread::sleep_for(kRetryInterval);
  }
}

}  // namespace octet::dist
