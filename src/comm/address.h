// Addresses and sockets of the rendezvous: MASTER_ADDR resolved once (with an
// error that says so, not a rendezvous that waits out its timeout on a name
// that never resolves), the local address that routes to it (where Gloo binds)
// and rank 0's listening socket for the store. Internal to src/comm/, not
// installed.
#pragma once

#include <sys/socket.h>

#include <chrono>
#include <cstdint>
#include <string>

namespace contrax::detail {

/// MASTER_ADDR `addr` resolved for `rank` (IPv4 first when the name has both).
sockaddr_storage resolve_master(const std::string& addr, int64_t rank);

/// Whether `a` is a loopback address (127.0.0.0/8, ::1): one that no other
/// host can reach.
bool is_loopback(const sockaddr_storage& a);

/// The numeric form of an address ("10.0.0.1", "::1").
std::string numeric_host(const sockaddr_storage& a);

/// The local address this machine uses to reach `master` ("" when there is no
/// route): a connected UDP socket sends nothing, it only asks the routing table.
std::string local_address_towards(const sockaddr_storage& master);

/// The name of the interface holding the local address `numeric` ("lo",
/// "eth0"), or "" when none does.
std::string interface_of(const std::string& numeric);

/// Rank 0's listening socket for the store on MASTER_ADDR `addr` (resolved:
/// `master`) and `port`. Failing, the error gives the reason in words (not a
/// local address, port taken) instead of TCPStore's "failed to listen on any
/// local network address".
int listen_on_master(const sockaddr_storage& master, const std::string& addr, int64_t port);

/// Tries to connect to `master`:`port` every 50 ms until one connection is
/// accepted (true) or `deadline` passes (false); each is closed at once. Lets
/// a rank find rank 0's store listening before TCPStore connects, so that
/// c10d's own retries (a random back-off of up to the whole timeout after a
/// failed try, PyTorch 2.4 and later) never stretch the wait past the deadline.
bool wait_until_listening(const sockaddr_storage& master, int64_t port,
                          std::chrono::steady_clock::time_point deadline);

}  // namespace contrax::detail
