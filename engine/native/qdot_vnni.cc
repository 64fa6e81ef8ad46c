// The AVX2 kernels of qdot_avx2.cc built again for CPUs with AVX-VNNI (Alder Lake and later,
// Sapphire Rapids, Zen 5): vpdpbusd does maddubs + madd + add in one instruction, vpdpwssd
// madd + add. Their int32 sums equal the AVX2 ones (maddubs never saturates on these operands:
// |signed| <= 127 after the sign trick, unsigned weights < 64), and every float step is the
// same, so these kernels give the AVX2 kernels' bits: only fewer instructions per block.
#define NPQ_TARGET "avx2,fma,f16c,avxvnni"
#define NPQ_ENTRY avxvnni_kernels
#define NPQ_ISA "avxvnni"
#define NPQ_CPU_HAS __builtin_cpu_supports("avxvnni")
#define NPQ_DOT_ADD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#define NPQ_PAIRS_ADD(acc, pairs, scales) _mm256_dpwssd_avx_epi32(acc, pairs, scales)
#include "qdot_avx2.cc"
