// Progress counters in shared memory, for collectives that ranks of one node run through a
// shared window without MPI calls on the way (mpidist/collectives/node_window.py and
// node_buckets.py), stored and loaded as the node window's flags are (node_host.h's HostFlags).
#pragma once

#include <cstdint>
#include <vector>

#include "node_host.h"

namespace mpidist {

inline void store_counter(std::uintptr_t address, std::uint64_t value) { node::HostFlags::publish(address, value); }

// Whether every counter has reached `value`.
inline bool counters_reached(const std::vector<std::uintptr_t>& addresses, std::uint64_t value) {
    for (auto address : addresses)
        if (node::HostFlags::load(address) < value) return false;
    return true;
}

}  // namespace mpidist
