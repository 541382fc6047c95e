// Progress counters in shared memory, for collectives that ranks of one node run through a
// shared window without MPI calls on the way (mpidist/collectives/polled.py).
//
// A rank publishes how far it got by storing a growing 64-bit count; the others poll it. The
// store is preceded by a full fence so that everything the rank wrote before it (memmove's
// non-temporal stores and OpenMP workers' stores included) is visible to whoever sees the new
// count; the loads acquire, so what a poller reads after seeing the count is at least as new.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

namespace mpidist {

inline void store_counter(std::uintptr_t address, std::uint64_t value) {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    __atomic_store_n(reinterpret_cast<std::uint64_t*>(address), value, __ATOMIC_RELEASE);
}

// Whether every counter has reached `value`.
inline bool counters_reached(const std::vector<std::uintptr_t>& addresses, std::uint64_t value) {
    for (auto address : addresses)
        if (__atomic_load_n(reinterpret_cast<const std::uint64_t*>(address), __ATOMIC_ACQUIRE) < value) return false;
    return true;
}

}  // namespace mpidist
