// The node window's flags in host shared memory (node_rounds.h's policy for the CPU path).
//
// publish is preceded by a full fence, so that everything the rank wrote before it (memcpy's
// non-temporal stores and OpenMP workers' stores included) is visible to whoever sees the new
// round; load acquires, so what a rank reads after seeing the round is at least as new. relax
// gives the core away: the ranks of a node may be more than its cores.
#pragma once

#include <sched.h>

#include <atomic>
#include <cstdint>

#include "node_steps.h"

namespace mpidist::node {

struct HostFlags {
    static void publish(std::uintptr_t flag, std::uint64_t round) {
        std::atomic_thread_fence(std::memory_order_seq_cst);
        std::atomic_ref<std::uint64_t>(*reinterpret_cast<std::uint64_t*>(flag)).store(round, std::memory_order_release);
    }
    static std::uint64_t load(std::uintptr_t flag) {
        return std::atomic_ref<std::uint64_t>(*reinterpret_cast<std::uint64_t*>(flag)).load(std::memory_order_acquire);
    }
    static void relax() { sched_yield(); }
};

// allreduce_steps over HostFlags and host memory (memcpy, cpu::reduce_many_to).
int host_allreduce(const Allreduce& call, int step, double patience, int until);

}  // namespace mpidist::node
