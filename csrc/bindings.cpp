// Python bindings of the mpidist._C extension.
#include <pybind11/pybind11.h>

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
    m.doc() = "mpidist fused reduction kernels (CPU, and CUDA when built with it)";
#ifdef MPIDIST_WITH_CUDA
    m.attr("built_with_cuda") = true;
#else
    m.attr("built_with_cuda") = false;
#endif
}
