// The node window's rounds (mpidist/collectives/node_window.py), written once over a flag policy.
//
// Every local rank has a 64-bit counter on a cache line of its own that only grows. A rank says it
// has reached round r by storing r once all its writes before it are complete (publish); it waits
// for round r by loading every other rank's counter until each has reached r (reached, await).
// The policy says how a flag is stored, loaded and waited on in the memory it lives in:
//
//   struct Flags {
//       static void publish(std::uintptr_t flag, std::uint64_t round);  // release, after a fence
//       static std::uint64_t load(std::uintptr_t flag);                  // acquire
//       static void relax();                                            // between two polls
//   };
//
// HostFlags (node_host.h) is host shared memory; memory that GPU kernels order brings a policy of
// its own, and the steps of a collective over the window (node_steps.h) stay the same.
#pragma once

#include <chrono>
#include <cstdint>
#include <vector>

namespace mpidist::node {

template <class Flags>
struct Rounds {
    const std::vector<std::uintptr_t>& counters;  // every local rank's, in local-rank order
    int local_rank;

    void publish(std::uint64_t round) const { Flags::publish(counters[local_rank], round); }

    // The first local rank other than this one whose counter is below `round`, or -1.
    int first_behind(std::uint64_t round) const {
        for (std::size_t k = 0; k < counters.size(); ++k)
            if (static_cast<int>(k) != local_rank && Flags::load(counters[k]) < round) return static_cast<int>(k);
        return -1;
    }

    // Whether every other local rank reaches `round` within `patience` seconds of polling. The
    // caller waits on past that (mpidist's deadline wait: the stall report, a peer that exited,
    // MPIDIST_TIMEOUT naming the rank behind).
    bool await(std::uint64_t round, double patience) const {
        int behind = first_behind(round);
        if (behind < 0) return true;
        const auto start = std::chrono::steady_clock::now();
        const auto limit = std::chrono::duration<double>(patience);
        for (;;) {
            // Once a rank has arrived it stays arrived: go on from the one still behind.
            while (Flags::load(counters[behind]) >= round) {
                behind = first_behind(round);
                if (behind < 0) return true;
            }
            if (std::chrono::steady_clock::now() - start > limit) return false;
            Flags::relax();
        }
    }
};

}  // namespace mpidist::node
