/* Route libFuzzer's coverage/compare hooks to Atheris under a GCC ASan preload.
 *
 * Atheris' libFuzzer (atheris/core_with_libfuzzer*.so, loaded RTLD_LOCAL by Python) reports
 * Python coverage by calling __sanitizer_cov_8bit_counters_init / __sanitizer_cov_pcs_init
 * through the global symbol scope. GCC's libasan.so, LD_PRELOADed for the sanitized kernels,
 * exports weak no-op versions of those hooks, and a preloaded library wins the lookup:
 * libFuzzer then sees no coverage at all ("no interesting inputs"). Atheris' own fix is a
 * clang-built asan_with_fuzzer.so; without clang, this shim is preloaded FIRST and forwards
 * each hook to the Atheris module's own definition (tail calls: libFuzzer reads the caller's
 * PC from the return address, which must stay the instrumented call site).
 *
 * Built and preloaded by scripts/fuzz.sh; nothing here runs outside a fuzz/replay run.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

static int find_core(struct dl_phdr_info *info, size_t size, void *out) {
    (void)size;
    if (info->dlpi_name && strstr(info->dlpi_name, "atheris/core_with_libfuzzer")) {
        *(void **)out = dlopen(info->dlpi_name, RTLD_NOW | RTLD_NOLOAD);
        return 1;
    }
    return 0;
}

/* The Atheris module's definition of `name`, or NULL while Atheris is not loaded yet. */
static void *resolve(const char *name) {
    static void *core;
    if (!core)
        dl_iterate_phdr(find_core, &core);
    return core ? dlsym(core, name) : NULL;
}

#define FWD(name, params, args)                                  \
    void name params {                                           \
        static void (*fn) params;                                \
        if (!fn) fn = (void (*) params)resolve(#name);            \
        if (fn) fn args;                                         \
    }

FWD(__sanitizer_cov_8bit_counters_init, (uint8_t *a, uint8_t *b), (a, b))
FWD(__sanitizer_cov_pcs_init, (const uintptr_t *a, const uintptr_t *b), (a, b))
FWD(__sanitizer_cov_trace_cmp1, (uint8_t a, uint8_t b), (a, b))
FWD(__sanitizer_cov_trace_cmp2, (uint16_t a, uint16_t b), (a, b))
FWD(__sanitizer_cov_trace_cmp4, (uint32_t a, uint32_t b), (a, b))
FWD(__sanitizer_cov_trace_cmp8, (uint64_t a, uint64_t b), (a, b))
FWD(__sanitizer_cov_trace_const_cmp1, (uint8_t a, uint8_t b), (a, b))
FWD(__sanitizer_cov_trace_const_cmp2, (uint16_t a, uint16_t b), (a, b))
FWD(__sanitizer_cov_trace_const_cmp4, (uint32_t a, uint32_t b), (a, b))
FWD(__sanitizer_cov_trace_const_cmp8, (uint64_t a, uint64_t b), (a, b))
FWD(__sanitizer_cov_trace_switch, (uint64_t v, uint64_t *cases), (v, cases))
FWD(__sanitizer_cov_trace_div4, (uint32_t v), (v))
FWD(__sanitizer_cov_trace_div8, (uint64_t v), (v))
FWD(__sanitizer_cov_trace_gep, (uintptr_t v), (v))
FWD(__sanitizer_cov_trace_pc_indir, (uintptr_t v), (v))
/* called by libasan's memcmp/strcmp interceptors: comparison operands for the mutator */
FWD(__sanitizer_weak_hook_memcmp,
    (void *pc, const void *a, const void *b, size_t n, int r), (pc, a, b, n, r))
FWD(__sanitizer_weak_hook_strncmp,
    (void *pc, const char *a, const char *b, size_t n, int r), (pc, a, b, n, r))
FWD(__sanitizer_weak_hook_strcmp, (void *pc, const char *a, const char *b, int r), (pc, a, b, r))
/* GCC's trace-cmp also instruments float/double compares; libFuzzer has no hook for them */
void __sanitizer_cov_trace_cmpf(float a, float b) { (void)a; (void)b; }
void __sanitizer_cov_trace_cmpd(double a, double b) { (void)a; (void)b; }
