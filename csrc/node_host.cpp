// The all-reduce on one node (node_steps.h) in host shared memory: the CPU path's one call.
#include "node_host.h"

#include <cstring>

#include "node_steps.h"

namespace mpidist::node {

namespace {

struct HostMemory {
    static void copy(std::uintptr_t dst, std::uintptr_t src, std::size_t nbytes) {
        std::memcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), nbytes);
    }
    static bool equal(std::uintptr_t a, std::uintptr_t b, std::size_t nbytes) {
        return std::memcmp(reinterpret_cast<const void*>(a), reinterpret_cast<const void*>(b), nbytes) == 0;
    }
    static void reduce(const std::vector<void*>& dsts, const std::vector<const void*>& srcs, std::size_t count,
                       DType dtype, Op op, double scale) {
        cpu::reduce_many_to(dsts, srcs, count, dtype, op, scale);
    }
};

}  // namespace

int host_allreduce(const Allreduce& call, int step, double patience, int until) {
    return allreduce_steps<HostFlags, HostMemory>(call, step, patience, until);
}

}  // namespace mpidist::node
