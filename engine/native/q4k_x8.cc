// Q4_K matrices regrouped eight rows at a time (Q4KX8, qblocks.h) for the eight-row kernels,
// one copy per weight tensor per process: a model's graph sessions share its mapped GGUF
// tensors (gguf_initializers), so the QMatMul kernels of all of them find the one regrouped copy
// by the tensor's address, size and a sample of its bytes instead of each making its own.
#include "q4k_x8.h"

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>

#include <sys/mman.h>
#include <unistd.h>

namespace npq {

void repack_q4_k_x8(const uint8_t* w, size_t row_bytes, int nb, Q4KX8* out) {
  for (int b = 0; b < nb; ++b) {
    Q4KX8& o = out[b];
    for (int r = 0; r < 8; ++r) {
      const uint8_t* blk = w + r * row_bytes + static_cast<size_t>(b) * 144;
      std::memcpy(&o.d[r], blk, 2);
      std::memcpy(&o.dmin[r], blk + 2, 2);
      for (int s = 0; s < 8; ++s) {
        int sc, mn;
        q4k_scale_min(blk + 4, s, &sc, &mn);
        o.scales[s][r] = static_cast<uint8_t>(sc);
        o.mins[s / 2][2 * r + s % 2] = static_cast<uint8_t>(mn);
      }
      for (int j = 0; j < 4; ++j) {
        for (int g = 0; g < 8; ++g) std::memcpy(&o.qs[j][g][4 * r], blk + 16 + 32 * j + 4 * g, 4);
      }
    }
  }
}

namespace {

// FNV-1a over the tensor's first and last 256 bytes: another tensor that later takes the same
// address (a model loaded again) is not mistaken for this one.
uint64_t sample(const uint8_t* w, size_t bytes) {
  uint64_t h = 1469598103934665603ull;
  const size_t n = bytes < 256 ? bytes : 256;
  for (size_t i = 0; i < n; ++i) h = (h ^ w[i]) * 1099511628211ull;
  for (size_t i = bytes - n; i < bytes; ++i) h = (h ^ w[i]) * 1099511628211ull;
  return h;
}

// Ask the kernel to reclaim the resident pages wholly inside [p, p + bytes): the source of a
// regrouped copy is not read again, and its pages (the GGUF's, mapped) would otherwise stay in
// the process's RSS beside the copy. MADV_PAGEOUT never changes what the memory holds (Linux
// 5.4+; elsewhere, or refused, the pages simply stay).
void give_back(const uint8_t* p, size_t bytes) {
#ifdef MADV_PAGEOUT
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t start = (reinterpret_cast<uintptr_t>(p) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) / page * page;
  if (end > start) madvise(reinterpret_cast<void*>(start), end - start, MADV_PAGEOUT);
#else
  (void)p;
  (void)bytes;
#endif
}

}  // namespace

std::shared_ptr<const uint8_t> shared_q4_k_x8(const uint8_t* w, size_t row_bytes, int64_t n) {
  using Key = std::tuple<const uint8_t*, size_t, int64_t, uint64_t>;
  static std::mutex lock;
  static std::map<Key, std::weak_ptr<const uint8_t>> copies;
  const Key key{w, row_bytes, n, sample(w, row_bytes * static_cast<size_t>(n))};
  const std::lock_guard<std::mutex> hold(lock);
  for (auto it = copies.begin(); it != copies.end();) {  // forget copies no kernel holds
    it = it->second.expired() ? copies.erase(it) : std::next(it);
  }
  auto found = copies.find(key);
  if (found != copies.end()) return found->second.lock();
  const int nb = static_cast<int>(row_bytes / 144);
  const size_t bytes = static_cast<size_t>(n / 8) * nb * sizeof(Q4KX8);
  void* raw = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (raw == nullptr) return nullptr;
  Q4KX8* out = static_cast<Q4KX8*>(raw);
  for (int64_t g = 0; g < n / 8; ++g) {
    repack_q4_k_x8(w + static_cast<size_t>(g) * 8 * row_bytes, row_bytes, nb, out + g * nb);
  }
  give_back(w, row_bytes * static_cast<size_t>(n));
  std::shared_ptr<const uint8_t> copy(static_cast<const uint8_t*>(raw),
                                      [](const uint8_t* p) { std::free(const_cast<uint8_t*>(p)); });
  copies[key] = copy;
  return copy;
}

}  // namespace npq
