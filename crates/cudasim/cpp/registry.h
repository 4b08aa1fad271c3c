// A host-compiled kernel: its name, parameter sizes and a function that unpacks
// cuLaunchKernel's `void**` into a typed call, as the device does.
#pragma once
#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>

struct KernelInfo {
    const char* name;
    size_t nparams;
    const size_t* param_sizes;
    void (*invoke)(void* fn, void** args);
    void* fn;
};

template <class... A>
struct KernelInvoker {
    template <size_t... I>
    static void call(void (*f)(A...), void** args, std::index_sequence<I...>) {
        f(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(args[I])...);
    }
    static void invoke(void* fn, void** args) {
        call(reinterpret_cast<void (*)(A...)>(fn), args, std::index_sequence_for<A...>{});
    }
};

template <class... A>
KernelInfo kernel_info(const char* name, void (*f)(A...)) {
    static const size_t sizes[] = {sizeof(A)..., 0};
    return KernelInfo{name, sizeof...(A), sizes, &KernelInvoker<A...>::invoke,
                      reinterpret_cast<void*>(f)};
}
