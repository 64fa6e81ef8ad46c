// Portable kernels: the activation quantizers every path shares, and plain-C dot products for
// CPUs without AVX2. Integer sums per block are exact; each block adds one float product.
#include <cmath>
#include <cstdlib>

#include "exp_x86.h"
#include "qblocks.h"

namespace npq {

namespace {

// One int8 scale per `n` values: d = max|x| / 127, q = round-half-even(x / d).
float quantize_run(const float* x, int8_t* q, int n) {
  float amax = 0.0f;
  for (int i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  if (amax == 0.0f) {
    std::memset(q, 0, static_cast<size_t>(n));
    return 0.0f;
  }
  const float d = amax / 127.0f;
  const float id = 127.0f / amax;
  for (int i = 0; i < n; ++i) {
    const long v = std::lrintf(x[i] * id);
    q[i] = static_cast<int8_t>(v > 127 ? 127 : (v < -127 ? -127 : v));
  }
  return d;
}

float dot_q8_0(const uint8_t* w, const ActBlock* x, int nb) {
  float acc = 0.0f;
  for (int b = 0; b < nb; ++b, w += 34) {
    const int8_t* q = reinterpret_cast<const int8_t*>(w + 2);
    int s = 0;
    for (int i = 0; i < QK; ++i) s += q[i] * x[b].qs[i];
    acc = std::fma(static_cast<float>(s), load_half(w) * x[b].d, acc);
  }
  return acc;
}

// Row i of eight regrouped rows (Q8X8) . one activation row: dot_q8_0's integers and steps.
float dot_q8_0_x8(const Q8X8* w, int i, const ActBlock* x, int nb) {
  float acc = 0.0f;
  for (int b = 0; b < nb; ++b) {
    int s = 0;
    for (int e = 0; e < QK; ++e) s += (w[b].qs[e / 4][4 * i + e % 4] - 128) * x[b].qs[e];
    acc = std::fma(static_cast<float>(s), half_to_float(w[b].d[i]) * x[b].d, acc);
  }
  return acc;
}

float dot_q4_0(const uint8_t* w, const ActBlock* x, int nb) {
  float acc = 0.0f;
  for (int b = 0; b < nb; ++b, w += 18) {
    const uint8_t* q = w + 2;
    int s = 0;
    for (int j = 0; j < 16; ++j) {
      s += ((q[j] & 0xF) - 8) * x[b].qs[j] + ((q[j] >> 4) - 8) * x[b].qs[j + 16];
    }
    acc += load_half(w) * x[b].d * static_cast<float>(s);
  }
  return acc;
}

float dot_q4_1(const uint8_t* w, const ActBlock* x, int nb) {
  float acc = 0.0f, off = 0.0f;
  for (int b = 0; b < nb; ++b, w += 20) {
    const uint8_t* q = w + 4;
    int s = 0;
    for (int j = 0; j < 16; ++j) s += (q[j] & 0xF) * x[b].qs[j] + (q[j] >> 4) * x[b].qs[j + 16];
    acc = std::fma(static_cast<float>(s), load_half(w) * x[b].d, acc);
    off = std::fma(load_half(w + 2), x[b].sum, off);
  }
  return acc + off;
}

// Row i of eight regrouped rows (Q41X8) . one activation row: dot_q4_1's integers and steps.
float dot_q4_1_x8(const Q41X8* w, int i, const ActBlock* x, int nb) {
  float acc = 0.0f, off = 0.0f;
  for (int b = 0; b < nb; ++b) {
    const Q41X8& q = w[b];
    int s = 0;
    for (int e = 0; e < QK; ++e) {
      const uint8_t byte = q.qs[(e % 16) / 4][4 * i + e % 4];
      s += (e < 16 ? (byte & 0xF) : (byte >> 4)) * x[b].qs[e];
    }
    acc = std::fma(static_cast<float>(s), half_to_float(q.d[i]) * x[b].d, acc);
    off = std::fma(half_to_float(q.m[i]), x[b].sum, off);
  }
  return acc + off;
}

float dot_q5_0(const uint8_t* w, const ActBlock* x, int nb) {
  float acc = 0.0f;
  for (int b = 0; b < nb; ++b, w += 22) {
    uint32_t qh;
    std::memcpy(&qh, w + 2, 4);
    const uint8_t* q = w + 6;
    int s = 0;
    for (int j = 0; j < 16; ++j) {
      const int lo = ((q[j] & 0xF) | (((qh >> j) << 4) & 0x10)) - 16;
      const int hi = ((q[j] >> 4) | ((qh >> (j + 12)) & 0x10)) - 16;
      s += lo * x[b].qs[j] + hi * x[b].qs[j + 16];
    }
    acc = std::fma(static_cast<float>(s), load_half(w) * x[b].d, acc);
  }
  return acc;
}

// Row i of eight regrouped rows (Q5X8) . one activation row: dot_q5_0's integers and steps.
float dot_q5_0_x8(const Q5X8* w, int i, const ActBlock* x, int nb) {
  float acc = 0.0f;
  for (int b = 0; b < nb; ++b) {
    const Q5X8& q = w[b];
    int s = 0;
    for (int e = 0; e < QK; ++e) {
      const int h = e / 16, g = (e % 16) / 4, t = e % 4;
      const uint8_t byte = q.qs[g][4 * i + t];
      const int bit = (q.qh[4 * i + t] >> (2 * g + h)) & 1;
      s += (((h == 0 ? (byte & 0xF) : (byte >> 4)) | (bit << 4)) - 16) * x[b].qs[e];
    }
    acc = std::fma(static_cast<float>(s), half_to_float(q.d[i]) * x[b].d, acc);
  }
  return acc;
}

// Eight regrouped rows of a 32-element type, one row at a time.
template <typename Block, float (*Dot)(const Block*, int, const ActBlock*, int)>
void blocks_x8(const uint8_t* w, const uint8_t* const* x, int rows, int nb, float* out) {
  const Block* q = reinterpret_cast<const Block*>(w);
  for (int r = 0; r < rows; ++r) {
    const ActBlock* y = reinterpret_cast<const ActBlock*>(x[r]);
    for (int i = 0; i < 8; ++i) out[8 * r + i] = Dot(q, i, y, nb);
  }
}

// The Q4_K float steps (qblocks.h) on one block's integers.
inline void q4_k_step(int sumi, int summ, float d, float dmin, float dx, float* acc, float* accm) {
  *acc = std::fma(static_cast<float>(sumi), d * dx, *acc);
  *accm = std::fma(static_cast<float>(summ), dmin * dx, *accm);
}

float dot_q4_k(const uint8_t* w, const ActSuper* x, int nb) {
  float acc = 0.0f, accm = 0.0f;
  for (int b = 0; b < nb; ++b, w += 144) {
    const uint8_t* scales = w + 4;
    const uint8_t* qs = w + 16;
    const int8_t* y = x[b].qs;
    int sumi = 0, summ = 0;
    for (int j = 0; j < 4; ++j) {
      int sc0, m0, sc1, m1;
      q4k_scale_min(scales, 2 * j, &sc0, &m0);
      q4k_scale_min(scales, 2 * j + 1, &sc1, &m1);
      int lo = 0, hi = 0;
      for (int l = 0; l < 32; ++l) {
        lo += (qs[32 * j + l] & 0xF) * y[64 * j + l];
        hi += (qs[32 * j + l] >> 4) * y[64 * j + 32 + l];
      }
      sumi += sc0 * lo + sc1 * hi;
      summ += m0 * x[b].bsums32[2 * j] + m1 * x[b].bsums32[2 * j + 1];
    }
    q4_k_step(sumi, summ, load_half(w), load_half(w + 2), x[b].d, &acc, &accm);
  }
  return acc - accm;
}

// Row i of eight regrouped rows (Q4KX8) . one activation row: dot_q4_k's integers and steps.
float dot_q4_k_x8(const Q4KX8* w, int i, const ActSuper* x, int nb) {
  float acc = 0.0f, accm = 0.0f;
  for (int b = 0; b < nb; ++b) {
    const Q4KX8& q = w[b];
    int sumi = 0, summ = 0;
    for (int s = 0; s < 8; ++s) {
      int dot = 0;
      for (int e = 0; e < 32; ++e) {
        const uint8_t byte = q.qs[s / 2][e / 4][4 * i + e % 4];
        dot += ((s % 2 == 0) ? (byte & 0xF) : (byte >> 4)) * x[b].qs[32 * s + e];
      }
      sumi += q.scales[s][i] * dot;
      summ += q.mins[s / 2][2 * i + s % 2] * x[b].bsums32[s];
    }
    q4_k_step(sumi, summ, half_to_float(q.d[i]), half_to_float(q.dmin[i]), x[b].d, &acc, &accm);
  }
  return acc - accm;
}

void q4_k_x8(const uint8_t* w, const uint8_t* const* x, int rows, int nb, float* out) {
  const Q4KX8* q = reinterpret_cast<const Q4KX8*>(w);
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < 8; ++i) {
      out[8 * r + i] = dot_q4_k_x8(q, i, reinterpret_cast<const ActSuper*>(x[r]), nb);
    }
  }
}

float dot_q6_k(const uint8_t* w, const ActSuper* x, int nb) {
  float acc = 0.0f;
  for (int b = 0; b < nb; ++b, w += 210) {
    const uint8_t* ql = w;
    const uint8_t* qh = w + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
    const int8_t* y = x[b].qs;
    int sumi = 0;
    for (int h = 0; h < 2; ++h, ql += 64, qh += 32, sc += 8, y += 128) {
      int part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int l = 0; l < 32; ++l) {
        const int g = l / 16;
        part[g + 0] += (((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32) * y[l];
        part[g + 2] += (((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32) * y[l + 32];
        part[g + 4] += (((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32) * y[l + 64];
        part[g + 6] += (((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32) * y[l + 96];
      }
      for (int g = 0; g < 8; ++g) sumi += sc[g] * part[g];
    }
    acc = std::fma(static_cast<float>(sumi), load_half(w + 208) * x[b].d, acc);
  }
  return acc;
}

// Row i of eight regrouped rows (Q6KX8) . one activation row: dot_q6_k's integers and steps.
float dot_q6_k_x8(const Q6KX8* w, int i, const ActSuper* x, int nb) {
  float acc = 0.0f;
  for (int b = 0; b < nb; ++b) {
    const Q6KX8& q = w[b];
    int sumi = 0;
    for (int s = 0; s < 16; ++s) {
      const int half = s / 8, quarter = (s % 8) / 2;
      int dot = 0;
      for (int e = 0; e < 16; ++e) {
        const int l = 16 * (s % 2) + e, g = l / 4, t = l % 4;
        const uint8_t lo = q.q[half][g][quarter % 2][4 * i + t];
        const uint8_t hi = q.q[half][g][2][4 * i + t];
        const int v = (quarter < 2 ? (lo & 0xF) : (lo >> 4)) | (((hi >> (2 * quarter)) & 3) << 4);
        dot += (v - 32) * x[b].qs[16 * s + e];
      }
      sumi += q.scales[s / 2][2 * i + s % 2] * dot;
    }
    acc = std::fma(static_cast<float>(sumi), half_to_float(q.d[i]) * x[b].d, acc);
  }
  return acc;
}

void q6_k_x8(const uint8_t* w, const uint8_t* const* x, int rows, int nb, float* out) {
  const Q6KX8* q = reinterpret_cast<const Q6KX8*>(w);
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < 8; ++i) {
      out[8 * r + i] = dot_q6_k_x8(q, i, reinterpret_cast<const ActSuper*>(x[r]), nb);
    }
  }
}

template <typename Act, float (*Dot)(const uint8_t*, const Act*, int)>
void rows_of(const uint8_t* w, const uint8_t* const* x, int rows, int nb, float* out) {
  for (int r = 0; r < rows; ++r) out[r] = Dot(w, reinterpret_cast<const Act*>(x[r]), nb);
}

template <typename Act, float (*Dot)(const uint8_t*, const Act*, int)>
void cols_of(const uint8_t* w, size_t stride, const uint8_t* x, int n, int nb, float* out) {
  for (int i = 0; i < n; ++i) out[i] = Dot(w + i * stride, reinterpret_cast<const Act*>(x), nb);
}

void quantize_blocks(const float* x, ActBlock* y, int k) {
  for (int b = 0; b < k / QK; ++b) {
    y[b].d = quantize_run(x + b * QK, y[b].qs, QK);
    block_sum(&y[b]);
  }
}

void quantize_supers(const float* x, ActSuper* y, int k) {
  for (int b = 0; b < k / QK_K; ++b) {
    y[b].d = quantize_run(x + b * QK_K, y[b].qs, QK_K);
    super_sums(&y[b]);
  }
}

void swiglu(const float* gate, const float* up, float* out, int n) {
  for (int i = 0; i < n; ++i) out[i] = npuchat_exp::swiglu1(gate[i], up[i]);
}

}  // namespace

const Kernels& scalar_kernels() {
  static const Kernels k{"scalar",
                         rows_of<ActBlock, dot_q4_0>,
                         rows_of<ActBlock, dot_q4_1>,
                         rows_of<ActBlock, dot_q5_0>,
                         rows_of<ActBlock, dot_q8_0>,
                         rows_of<ActSuper, dot_q4_k>,
                         rows_of<ActSuper, dot_q6_k>,
                         quantize_blocks,
                         quantize_supers,
                         cols_of<ActBlock, dot_q4_0>,
                         cols_of<ActBlock, dot_q4_1>,
                         cols_of<ActBlock, dot_q5_0>,
                         cols_of<ActBlock, dot_q8_0>,
                         cols_of<ActSuper, dot_q4_k>,
                         cols_of<ActSuper, dot_q6_k>,
                         q4_k_x8,
                         q6_k_x8,
                         blocks_x8<Q8X8, dot_q8_0_x8>,
                         blocks_x8<Q5X8, dot_q5_0_x8>,
                         blocks_x8<Q41X8, dot_q4_1_x8>,
                         swiglu};
  return k;
}

// The fastest table this CPU runs, or the one NPUCHAT_KERNEL_ISA names (the next below it where
// the CPU lacks it). The two VNNI tables are the same kernels (and bits) in EVEX and VEX form;
// EVEX first: with AVX-512VL the compiler has 32 vector registers (3-20% less CPU than the VEX
// build on many-row calls, on a Xeon with both).
const Kernels& chosen_kernels() {
  static const Kernels* chosen = [] {
    const char* names[] = {"avx512vnni", "avxvnni", "avx2", "scalar"};
    const Kernels* tables[] = {avx512vnni_kernels(), avxvnni_kernels(), avx2_kernels(),
                               &scalar_kernels()};
    const char* force = std::getenv("NPUCHAT_KERNEL_ISA");
    int i = 0;
    while (force != nullptr && i < 3 && std::strcmp(force, names[i]) != 0) ++i;
    if (force != nullptr && std::strcmp(force, names[i]) != 0) i = 0;  // unknown: the default
    while (tables[i] == nullptr) ++i;
    return tables[i];
  }();
  return *chosen;
}

}  // namespace npq
