// Where Gloo binds for MASTER_ADDR (see comm/gloo_binding.h).
#include "comm/gloo_binding.h"

#include <c10/util/Exception.h>

#include <cstdlib>

#include "comm/address.h"

namespace contrax::detail {

GlooBinding choose_gloo_binding(const std::string& master_addr) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) {
    return {GlooBinding::Kind::kInterface, ifname, "GLOO_SOCKET_IFNAME"};
  }
  if (master_addr == "127.0.0.1" || master_addr == "localhost" || master_addr == "::1") {
    return {GlooBinding::Kind::kAddress, "127.0.0.1", "MASTER_ADDR " + master_addr + " is this machine's loopback"};
  }
  try {
    const std::string local = local_address_towards(resolve_master(master_addr, -1));
    if (!local.empty()) return {GlooBinding::Kind::kAddress, local, "the route to MASTER_ADDR " + master_addr};
    return {GlooBinding::Kind::kHostName, "", "no route to MASTER_ADDR " + master_addr};
  } catch (const c10::Error&) {
    // Unresolvable: the rendezvous reports that.
    return {GlooBinding::Kind::kHostName, "", "MASTER_ADDR " + master_addr + " does not resolve"};
  }
}

}  // namespace contrax::detail
