// The AVX2 kernels of qdot_avx2.cc built again for CPUs with AVX-512 VNNI but no AVX-VNNI (Ice
// Lake, Zen 4): the EVEX forms of vpdpbusd / vpdpwssd on 256-bit registers, with the same int32
// sums and float steps as qdot_vnni.cc, so the same bits as the AVX2 kernels.
#define NPQ_TARGET "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni"
#define NPQ_ENTRY avx512vnni_kernels
#define NPQ_ISA "avx512vnni"
#define NPQ_CPU_HAS                                                             \
  (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") && \
   __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni"))
#define NPQ_DOT_ADD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#define NPQ_PAIRS_ADD(acc, pairs, scales) _mm256_dpwssd_epi32(acc, pairs, scales)
#define NPQ_X8_PASS 8  // 32 vector registers: eight activation rows a pass
#define NPQ_EVEX_BCAST 1  // dot_bcast: vpdpbusd with an embedded broadcast (qdot_x86.h)
#include "qdot_avx2.cc"
