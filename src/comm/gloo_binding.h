// Where Gloo binds for MASTER_ADDR: Gloo's usual interface override; the
// loopback for a loopback MASTER_ADDR; else the local address of the route to
// rank 0 (the machine's host name may resolve to an address of another
// interface, or of no interface at all inside a network namespace, so that
// Gloo's sockets, like the store's, live on the interface of MASTER_ADDR);
// the host name's address only where there is no route. One decision for the
// process group's Gloo device (process_group.cpp) and for its description
// (contrax::gloo_binding, communicator.cpp). Internal to src/comm/.
#pragma once

#include <string>

namespace contrax::detail {

/// The decision: an interface by name, a numeric address, or the host name's.
struct GlooBinding {
  enum class Kind { kInterface, kAddress, kHostName } kind;
  std::string where;  // interface name or numeric address
  std::string why;
};

/// Decides where Gloo binds for `master_addr` (never throws: an unresolvable
/// address is left to the rendezvous to report).
GlooBinding choose_gloo_binding(const std::string& master_addr);

}  // namespace contrax::detail
