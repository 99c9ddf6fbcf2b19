// Live tensor bytes of a process, for bench/pipeline.py's memory comparison: loaded with
// LD_PRELOAD into both the dtensor and the PyTorch ranks, it counts the bytes allocated by
// posix_memalign and not yet freed. LibTorch's CPU allocator (c10::alloc_cpu) takes every
// tensor's memory through posix_memalign, in the C++ process and under Python alike, while
// the interpreter's own objects come from malloc and pymalloc's arenas: the same measure on
// both sides, blind to what glibc keeps after a free (which the resident set includes).
//
// Read through dlsym(RTLD_DEFAULT, ...) (C++) or ctypes.CDLL(None) (Python):
//   live_bytes_now(), live_bytes_peak(), live_bytes_reset_peak() (the peak restarts at now).
// The table of live blocks is fixed (kSlots, linear probing with backward-shift deletion);
// blocks beyond it are not counted and counted in live_bytes_dropped().
#include <pthread.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>

extern "C" {
void* __libc_memalign(size_t alignment, size_t size);
void __libc_free(void* ptr);
int posix_memalign(void** out, size_t alignment, size_t size);
void free(void* ptr);
int64_t live_bytes_now();
int64_t live_bytes_peak();
void live_bytes_reset_peak();
int64_t live_bytes_dropped();
}

namespace {

constexpr size_t kSlots = size_t{1} << 20;

struct Entry {
  uintptr_t ptr;
  size_t size;
};
Entry table[kSlots];
size_t used;
int64_t live, peak, dropped;
pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

size_t slot_of(uintptr_t p) {
  return static_cast<size_t>((p >> 4) * 0x9E3779B97F4A7C15ull >> 44) & (kSlots - 1);
}

void insert(uintptr_t p, size_t size) {
  pthread_mutex_lock(&lock);
  if (used + 1 >= kSlots / 2) {
    dropped += 1;
  } else {
    size_t i = slot_of(p);
    while (table[i].ptr != 0) {
      i = (i + 1) & (kSlots - 1);
    }
    table[i].ptr = p;
    table[i].size = size;
    used += 1;
    live += static_cast<int64_t>(size);
    if (live > peak) {
      peak = live;
    }
  }
  pthread_mutex_unlock(&lock);
}

void erase(uintptr_t p) {
  pthread_mutex_lock(&lock);
  size_t i = slot_of(p);
  while (table[i].ptr != 0 && table[i].ptr != p) {
    i = (i + 1) & (kSlots - 1);
  }
  if (table[i].ptr == p) {
    live -= static_cast<int64_t>(table[i].size);
    used -= 1;
    // Backward-shift deletion: move later entries of the run into the hole when their home
    // slot allows it, so that lookups never stop early.
    size_t hole = i;
    size_t j = i;
    for (;;) {
      j = (j + 1) & (kSlots - 1);
      if (table[j].ptr == 0) {
        break;
      }
      const size_t home = slot_of(table[j].ptr);
      const bool between = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
      if (!between) {
        table[hole] = table[j];
        hole = j;
      }
    }
    table[hole].ptr = 0;
  }
  pthread_mutex_unlock(&lock);
}

} // namespace

extern "C" {

int posix_memalign(void** out, size_t alignment, size_t size) {
  void* p = __libc_memalign(alignment, size);
  if (p == nullptr && size != 0) {
    return ENOMEM;
  }
  *out = p;
  if (p != nullptr) {
    insert(reinterpret_cast<uintptr_t>(p), size);
  }
  return 0;
}

void free(void* ptr) {
  if (ptr != nullptr) {
    erase(reinterpret_cast<uintptr_t>(ptr));
  }
  __libc_free(ptr);
}

int64_t live_bytes_now() {
  pthread_mutex_lock(&lock);
  const int64_t v = live;
  pthread_mutex_unlock(&lock);
  return v;
}

int64_t live_bytes_peak() {
  pthread_mutex_lock(&lock);
  const int64_t v = peak;
  pthread_mutex_unlock(&lock);
  return v;
}

void live_bytes_reset_peak() {
  pthread_mutex_lock(&lock);
  peak = live;
  pthread_mutex_unlock(&lock);
}

int64_t live_bytes_dropped() {
  pthread_mutex_lock(&lock);
  const int64_t v = dropped;
  pthread_mutex_unlock(&lock);
  return v;
}

} // extern "C"
