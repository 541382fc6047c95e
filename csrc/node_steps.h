// The steps of the all-reduce on one node through the node window, over node_rounds.h's flags and
// a memory policy, so that host shared memory and GPU memory run the same steps:
//
//   struct Memory {
//       static void copy(std::uintptr_t dst, std::uintptr_t src, std::size_t nbytes);
//       static bool equal(std::uintptr_t a, std::uintptr_t b, std::size_t nbytes);  // same bytes
//       // every dsts[j] = (srcs[0] op ... op srcs[k-1]) * scale, in one pass, the sources in order
//       static void reduce(const std::vector<void*>& dsts, const std::vector<const void*>& srcs,
//                          std::size_t count, DType dtype, Op op, double scale);
//   };
//
// The buffer is one or more segments laid end to end (a gradient bucket's gradients where they
// lie); a byte range of it is read and written piece by piece (for_pieces).
//
// Sliced (L local ranks, the buffer cut in L slices as split_counts cuts it; two rounds):
//   0. copy into this rank's slot the slices the others reduce; publish round + 1;
//   1. await it; reduce this rank's slice of its own buffer and the others' slots, in local-rank
//      order, into its buffer and the slot it is published in (result_slot); publish round + 2;
//   2. await it; copy the others' results out.
// With results_in_slots every rank writes its reduced slice into its own slot and every other
// rank's instead (over the contributions it has just read there), so every slot ends with the
// whole result and step 2 copies nothing; a segment that already lies in this rank's slot (a
// gradient that is a view of it) is not copied in.
// One-shot (small messages; one round):
//   0. copy the whole buffer into this rank's slot; publish round + 1;
//   1. await it; reduce every rank's slot, in local-rank order, into the buffer.
// A checked one-shot (the call check's round, with or without the message) first writes the
// call's signature (kSignatureBytes) at the start of this rank's slot, the buffer after it, and
// after the round compares every rank's signature with its own: where one differs, it reduces
// nothing and returns kSignaturesDiffer, on every rank alike (they all read the same signatures).
// Either way every rank gets the same bits. The one-shot leaves while others may still read its
// slot: its slots are its own, and consecutive one-shot calls alternate between two halves of
// them (NodeWindow.next_one_shot_slots).
//
// allreduce_steps runs from `step` on and returns -1 once the result is in place (kSignaturesDiffer
// instead of it, above), or the step that
// waits when a rank is still behind after `patience` seconds of polling: the caller waits for
// round + step (with its deadline) and calls again from that step (patience 0: a polled
// all-reduce that never blocks). With `until` >= 0 it stops before that step, and returns it (the
// copy-in alone, or a test's pause between two steps).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "node_rounds.h"
#include "reduce.h"

namespace mpidist::node {

struct Segment {
    std::uintptr_t address;
    std::size_t nbytes;
};

// The room of a checked one-shot's signature at the start of each slot: one cache line.
constexpr std::size_t kSignatureBytes = 64;
// What a checked one-shot returns where the ranks' signatures differ.
constexpr int kSignaturesDiffer = -2;

struct Allreduce {
    std::vector<std::uintptr_t> slots;     // this call's slot of every local rank
    std::vector<std::uintptr_t> counters;  // every local rank's flag
    int local_rank;
    std::uint64_t round;                   // the round every local rank has passed before the call
    std::vector<Segment> buffer;           // laid end to end
    std::size_t count;                     // elements in all the segments
    DType dtype;
    Op op;
    double scale;
    bool results_in_slots;
    bool one_shot;
    const void* signature;                 // kSignatureBytes of a checked one-shot; nullptr: unchecked
};

inline int allreduce_round_count(bool one_shot) { return one_shot ? 1 : 2; }

// (first element, element count) of local rank k's slice: the first count % parts get one more.
inline std::pair<std::size_t, std::size_t> slice_of(std::size_t count, std::size_t parts, std::size_t k) {
    const std::size_t base = count / parts, extra = count % parts;
    return {k * base + (k < extra ? k : extra), base + (k < extra ? 1 : 0)};
}

// fn(address, offset, nbytes) for each part of bytes [start, start + length) of `segments` laid
// end to end; offset counts from the start of the first segment.
template <class Fn>
void for_pieces(const std::vector<Segment>& segments, std::size_t start, std::size_t length, Fn fn) {
    std::size_t position = 0;
    const std::size_t end = start + length;
    for (const auto& segment : segments) {
        const std::size_t low = start > position ? start : position;
        const std::size_t high = end < position + segment.nbytes ? end : position + segment.nbytes;
        if (low < high) fn(segment.address + (low - position), low, high - low);
        position += segment.nbytes;
        if (position >= end) break;
    }
}

template <class Flags, class Memory>
int allreduce_steps(const Allreduce& call, int step, double patience, int until) {
    const Rounds<Flags> rounds{call.counters, call.local_rank};
    const std::size_t size = call.slots.size(), me = static_cast<std::size_t>(call.local_rank);
    const std::size_t item = itemsize(call.dtype);
    const std::size_t skip = call.signature ? kSignatureBytes : 0;  // where the message starts in a slot
    auto reduce_pieces = [&](std::size_t first, std::size_t n, auto destinations) {
        for_pieces(call.buffer, first * item, n * item, [&](std::uintptr_t address, std::size_t offset, std::size_t bytes) {
            std::vector<const void*> sources;
            for (std::size_t k = 0; k < size; ++k)
                sources.push_back(reinterpret_cast<const void*>(k == me && !call.one_shot ? address : call.slots[k] + skip + offset));
            Memory::reduce(destinations(address, offset), sources, bytes / item, call.dtype, call.op, call.scale);
        });
    };
    if (call.one_shot) {
        if (step == 0) {
            if (call.signature) Memory::copy(call.slots[me], reinterpret_cast<std::uintptr_t>(call.signature), skip);
            for_pieces(call.buffer, 0, call.count * item, [&](std::uintptr_t address, std::size_t offset, std::size_t bytes) {
                Memory::copy(call.slots[me] + skip + offset, address, bytes);
            });
            rounds.publish(call.round + 1);
            step = 1;
        }
        if (until == 1) return 1;
        if (!rounds.await(call.round + 1, patience)) return 1;
        for (std::size_t k = 0; call.signature && k < size; ++k)
            if (k != me && !Memory::equal(call.slots[k], reinterpret_cast<std::uintptr_t>(call.signature), skip))
                return kSignaturesDiffer;
        reduce_pieces(0, call.count, [](std::uintptr_t address, std::size_t) {
            return std::vector<void*>{reinterpret_cast<void*>(address)};
        });
        return -1;
    }
    // With two ranks each publishes into the other's slot, over the copy of its slice it has just
    // read, and reads its peer's result out of its own (hierarchical.py's docstring says why).
    auto result_slot = [&](std::size_t owner) { return call.slots[size == 2 ? 1 - owner : owner]; };
    if (step == 0) {
        for (std::size_t k = 0; k < size; ++k) {
            const auto [first, n] = slice_of(call.count, size, k);
            if (k == me || !n) continue;
            for_pieces(call.buffer, first * item, n * item, [&](std::uintptr_t address, std::size_t offset, std::size_t bytes) {
                if (address != call.slots[me] + offset) Memory::copy(call.slots[me] + offset, address, bytes);
            });
        }
        rounds.publish(call.round + 1);
        step = 1;
    }
    if (until == 1) return 1;
    if (step == 1) {
        if (!rounds.await(call.round + 1, patience)) return 1;
        const auto [first, n] = slice_of(call.count, size, me);
        // reduce loads every operand of an element before storing it, so a destination may be one
        // of its sources: this rank's own buffer, or a slot holding a contribution just read.
        reduce_pieces(first, n, [&](std::uintptr_t address, std::size_t offset) {
            std::vector<void*> destinations;
            if (call.results_in_slots) {
                for (std::size_t k = 0; k < size; ++k)
                    destinations.push_back(reinterpret_cast<void*>(call.slots[(me + k) % size] + offset));
            } else {
                destinations = {reinterpret_cast<void*>(address), reinterpret_cast<void*>(result_slot(me) + offset)};
            }
            return destinations;
        });
        rounds.publish(call.round + 2);
        step = 2;
    }
    if (until == 2) return 2;
    if (!rounds.await(call.round + 2, patience)) return 2;
    if (call.results_in_slots) return -1;
    for (std::size_t k = 0; k < size; ++k) {
        const auto [first, n] = slice_of(call.count, size, k);
        if (k == me || !n) continue;
        for_pieces(call.buffer, first * item, n * item, [&](std::uintptr_t address, std::size_t offset, std::size_t bytes) {
            Memory::copy(address, result_slot(k) + offset, bytes);
        });
    }
    return -1;
}

}  // namespace mpidist::node
