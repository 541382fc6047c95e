// The steps of the all-reduce on one node through the node window, over node_rounds.h's flags and
// a memory policy, so that host shared memory and GPU memory run the same steps:
//
//   struct Memory {
//       static void copy(std::uintptr_t dst, std::uintptr_t src, std::size_t nbytes);
//       // every dsts[j] = (srcs[0] op ... op srcs[k-1]) * scale, in one pass, the sources in order
//       static void reduce(const std::vector<void*>& dsts, const std::vector<const void*>& srcs,
//                          std::size_t count, DType dtype, Op op, double scale);
//   };
//
// Sliced (L local ranks, the buffer cut in L slices as split_counts cuts it; two rounds):
//   0. copy into this rank's slot the slices the others reduce; publish round + 1;
//   1. await it; reduce this rank's slice of its own buffer and the others' slots, in local-rank
//      order, into its buffer and the slot it is published in (result_slot); publish round + 2;
//   2. await it; copy the others' results out.
// One-shot (small messages; one round):
//   0. copy the whole buffer into this rank's slot; publish round + 1;
//   1. await it; reduce every rank's slot, in local-rank order, into the buffer.
// Either way every rank gets the same bits. The one-shot leaves while others may still read its
// slot: its slots are its own, and consecutive one-shot calls alternate between two halves of
// them (NodeWindow.next_one_shot_slots).
//
// allreduce_steps runs from `step` on and returns -1 once the result is in place, or the step that
// waits when a rank is still behind after `patience` seconds of polling: the caller waits for
// round + step (with its deadline) and calls again from that step. With `until` >= 0 it stops
// before that step, and returns it (a test's pause between two steps).
#pragma once

#include <cstdint>
#include <vector>

#include "node_rounds.h"
#include "reduce.h"

namespace mpidist::node {

struct Allreduce {
    std::vector<std::uintptr_t> slots;     // this call's slot of every local rank
    std::vector<std::uintptr_t> counters;  // every local rank's flag
    int local_rank;
    std::uint64_t round;                   // the round every local rank has passed before the call
    std::uintptr_t buffer;
    std::size_t count;
    DType dtype;
    Op op;
    double scale;
    bool one_shot;
};

inline int allreduce_round_count(bool one_shot) { return one_shot ? 1 : 2; }

// (first element, element count) of local rank k's slice: the first count % parts get one more.
inline std::pair<std::size_t, std::size_t> slice_of(std::size_t count, std::size_t parts, std::size_t k) {
    const std::size_t base = count / parts, extra = count % parts;
    return {k * base + (k < extra ? k : extra), base + (k < extra ? 1 : 0)};
}

template <class Flags, class Memory>
int allreduce_steps(const Allreduce& call, int step, double patience, int until) {
    const Rounds<Flags> rounds{call.counters, call.local_rank};
    const std::size_t size = call.slots.size(), me = static_cast<std::size_t>(call.local_rank);
    const std::size_t item = itemsize(call.dtype);
    auto at = [&](std::uintptr_t base, std::size_t element) { return base + element * item; };
    if (call.one_shot) {
        if (step == 0) {
            Memory::copy(call.slots[me], call.buffer, call.count * item);
            rounds.publish(call.round + 1);
            step = 1;
        }
        if (until == 1) return 1;
        if (!rounds.await(call.round + 1, patience)) return 1;
        std::vector<const void*> sources;
        for (auto slot : call.slots) sources.push_back(reinterpret_cast<const void*>(slot));
        Memory::reduce({reinterpret_cast<void*>(call.buffer)}, sources, call.count, call.dtype, call.op, call.scale);
        return -1;
    }
    // With two ranks each publishes into the other's slot, over the copy of its slice it has just
    // read, and reads its peer's result out of its own (hierarchical.py's docstring says why).
    auto result_slot = [&](std::size_t owner) { return call.slots[size == 2 ? 1 - owner : owner]; };
    if (step == 0) {
        for (std::size_t k = 0; k < size; ++k) {
            const auto [first, n] = slice_of(call.count, size, k);
            if (k != me && n) Memory::copy(at(call.slots[me], first), at(call.buffer, first), n * item);
        }
        rounds.publish(call.round + 1);
        step = 1;
    }
    if (until == 1) return 1;
    if (step == 1) {
        if (!rounds.await(call.round + 1, patience)) return 1;
        const auto [first, n] = slice_of(call.count, size, me);
        if (n) {
            std::vector<const void*> sources;
            for (std::size_t k = 0; k < size; ++k)
                sources.push_back(reinterpret_cast<const void*>(at(k == me ? call.buffer : call.slots[k], first)));
            Memory::reduce({reinterpret_cast<void*>(at(call.buffer, first)), reinterpret_cast<void*>(at(result_slot(me), first))},
                           sources, n, call.dtype, call.op, call.scale);
        }
        rounds.publish(call.round + 2);
        step = 2;
    }
    if (until == 2) return 2;
    if (!rounds.await(call.round + 2, patience)) return 2;
    for (std::size_t k = 0; k < size; ++k) {
        const auto [first, n] = slice_of(call.count, size, k);
        if (k != me && n) Memory::copy(at(call.buffer, first), at(result_slot(k), first), n * item);
    }
    return -1;
}

}  // namespace mpidist::node
