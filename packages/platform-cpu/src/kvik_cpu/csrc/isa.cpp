// Which kernel paths this build of kvik_cpu's ops can run (kvik_cpu.isa asks it through
// torch.ops.kvik_cpu.built_isa). The build targets the host (-march=native), so this is what the
// compiler found on the CPU, and for AMX also whether Linux lets the process use the tiles.

#include <torch/library.h>

#include "amx.h"
#include "ops.h"

namespace kvik_cpu::ops {

int64_t built_isa() {
#ifdef KVIK_HAVE_AMX
  if (kvik_cpu::request_amx()) return kAmx;
#endif
#if defined(__AVX512BF16__)
  return kAvx512Bf16;
#else
  return kPlain;
#endif
}

}  // namespace kvik_cpu::ops

TORCH_LIBRARY_FRAGMENT(kvik_cpu, m) { m.def("built_isa() -> int", &kvik_cpu::ops::built_isa); }
