// Addresses and sockets of the rendezvous (see comm/address.h).
#include "comm/address.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <unistd.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

namespace contrax::detail {

namespace {

socklen_t addr_len(const sockaddr_storage& a) {
  return a.ss_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
}

void set_port(sockaddr_storage& a, int64_t port) {
  if (a.ss_family == AF_INET) {
    reinterpret_cast<sockaddr_in*>(&a)->sin_port = htons(static_cast<uint16_t>(port));
  } else {
    reinterpret_cast<sockaddr_in6*>(&a)->sin6_port = htons(static_cast<uint16_t>(port));
  }
}

}  // namespace

sockaddr_storage resolve_master(const std::string& addr, int64_t rank) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(addr.c_str(), nullptr, &hints, &found);
  TORCH_CHECK(rc == 0 && found != nullptr, "Communicator::create(): rank ", rank, " cannot resolve MASTER_ADDR '",
              addr, "': ", ::gai_strerror(rc), " (set MASTER_ADDR to rank 0's host name or IP address)");
  sockaddr_storage out{};
  // IPv4 first when the name has both: the addresses the other ranks are
  // given (and Gloo binds) are IPv4 on every setup this has met.
  const addrinfo* pick = found;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    if (a->ai_family == AF_INET) {
      pick = a;
      break;
    }
  }
  std::memcpy(&out, pick->ai_addr, pick->ai_addrlen);
  ::freeaddrinfo(found);
  return out;
}

bool is_loopback(const sockaddr_storage& a) {
  if (a.ss_family == AF_INET) {
    return (ntohl(reinterpret_cast<const sockaddr_in&>(a).sin_addr.s_addr) >> 24) == 127;
  }
  return a.ss_family == AF_INET6 && IN6_IS_ADDR_LOOPBACK(&reinterpret_cast<const sockaddr_in6&>(a).sin6_addr);
}

std::string numeric_host(const sockaddr_storage& a) {
  char buf[INET6_ADDRSTRLEN] = {0};
  if (a.ss_family == AF_INET) {
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&a)->sin_addr, buf, sizeof buf);
  } else {
    ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&a)->sin6_addr, buf, sizeof buf);
  }
  return buf;
}

std::string interface_of(const std::string& numeric) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return "";
  std::string name;
  for (ifaddrs* i = list; i != nullptr && name.empty(); i = i->ifa_next) {
    if (i->ifa_addr == nullptr || (i->ifa_addr->sa_family != AF_INET && i->ifa_addr->sa_family != AF_INET6)) continue;
    sockaddr_storage a{};
    std::memcpy(&a, i->ifa_addr, i->ifa_addr->sa_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6));
    if (numeric_host(a) == numeric) name = i->ifa_name;
  }
  ::freeifaddrs(list);
  return name;
}

std::string local_address_towards(const sockaddr_storage& master) {
  const int fd = ::socket(master.ss_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return "";
  sockaddr_storage probe = master;
  set_port(probe, 9);  // any port: nothing is sent
  sockaddr_storage local{};
  socklen_t len = sizeof local;
  std::string out;
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&probe), addr_len(probe)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
    out = numeric_host(local);
  }
  ::close(fd);
  return out;
}

int listen_on_master(const sockaddr_storage& master, const std::string& addr, int64_t port) {
  sockaddr_storage a = master;
  set_port(a, port);
  const int fd = ::socket(a.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  TORCH_CHECK(fd >= 0, "Communicator::create(): rank 0 cannot create a socket: ", std::strerror(errno));
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&a), addr_len(a)) != 0 || ::listen(fd, 1024) != 0) {
    const int err = errno;
    ::close(fd);
    TORCH_CHECK(err != EADDRNOTAVAIL, "Communicator::create(): rank 0 cannot listen on MASTER_ADDR ", addr, " (",
                numeric_host(master), "): it is not an address of this machine; rank 0 hosts the rendezvous "
                "store, so MASTER_ADDR must name rank 0's machine");
    TORCH_CHECK(err != EADDRINUSE, "Communicator::create(): rank 0 cannot listen on MASTER_ADDR ", addr, ":", port,
                ": the port is in use (another job, or a second process started as rank 0; pick another "
                "MASTER_PORT)");
    TORCH_CHECK(false, "Communicator::create(): rank 0 cannot listen on MASTER_ADDR ", addr, ":", port, ": ",
                std::strerror(err));
  }
  return fd;
}

bool wait_until_listening(const sockaddr_storage& master, int64_t port,
                          std::chrono::steady_clock::time_point deadline) {
  sockaddr_storage a = master;
  set_port(a, port);
  for (;;) {
    const int fd = ::socket(a.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return false;
    bool connected = ::connect(fd, reinterpret_cast<const sockaddr*>(&a), addr_len(a)) == 0;
    if (!connected && errno == EINPROGRESS) {
      // A connection that is neither accepted nor refused (a filtered port,
      // a host that is down) is waited for until the deadline, not longer.
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      pollfd p{fd, POLLOUT, 0};
      int err = 0;
      socklen_t len = sizeof err;
      connected = ::poll(&p, 1, static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(left.count(), 1000)))) == 1 &&
                  ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0;
    }
    ::close(fd);
    if (connected) return true;
    if (std::chrono::steady_clock::now() + std::chrono::milliseconds(50) >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

}  // namespace contrax::detail
