// Live tensor bytes of a process, for the memory comparisons of bench/pipeline.py, moe.py
// and context_parallel.py: loaded with LD_PRELOAD into the dtensor and the PyTorch ranks
// alike, it counts the bytes allocated by
// posix_memalign and not yet freed. LibTorch's CPU allocator (c10::alloc_cpu) takes every
// tensor's memory through posix_memalign, in the C++ process and under Python alike, while
// the interpreter's own objects come from malloc and pymalloc's arenas: the same measure on
// both sides, blind to what glibc keeps after a free (which the resident set includes).
//
// Read through dlsym(RTLD_DEFAULT, ...) (C++) or ctypes.CDLL(None) (Python):
//   live_bytes_now(), live_bytes_peak(), live_bytes_reset_peak() (the peak restarts at now).
// The table of live blocks is fixed (kSlots, linear probing with backward-shift deletion);
// blocks beyond it are not counted and counted in live_bytes_dropped().
// With LIVE_BYTES_HISTOGRAM set, the live blocks at the last peak (since the last reset),
// counted by size, are printed to stderr at exit ("live_bytes at peak: SIZE x COUNT"): where
// two processes' peaks differ, the sizes whose counts differ say which tensors. Two more,
// with it, say where they come from (glibc's backtrace; addr2line or c++filt resolve the frames):
//   LIVE_BYTES_BACKTRACE=1   the call stack of the allocation that set the last peak;
//   LIVE_BYTES_TRACE_SIZE=N  the call stacks of the blocks of N bytes live at the last peak
//                            (up to 64 such blocks at once are followed).
// LIVE_BYTES_DIR=DIR writes each process's report to DIR/live_bytes.PID.txt instead of stderr,
// where the reports of several ranks would interleave.
#include <execinfo.h>
#include <pthread.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

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

// Live blocks by size (open addressing, never deleted: sizes are few), and a copy taken
// at each new peak.
constexpr size_t kSizes = 4096;
struct SizeCount {
  size_t size;
  int64_t count;
};
SizeCount sizes[kSizes], at_peak[kSizes];
int histogram = -1; // -1: LIVE_BYTES_HISTOGRAM not read yet
// LIVE_BYTES_BACKTRACE: the call stack of the allocation that set the last peak.
void* peak_frames[64];
int peak_depth = 0;
// LIVE_BYTES_TRACE_SIZE: the blocks of that size followed, and a copy taken at each new peak.
struct Traced {
  uintptr_t ptr;
  int depth;
  void* frames[32];
};
constexpr int kTraced = 64;
Traced traced[kTraced], traced_at_peak[kTraced];
size_t trace_size = 0;

void count_size(size_t size, int64_t delta) {
  if (histogram < 0) {
    histogram = std::getenv("LIVE_BYTES_HISTOGRAM") != nullptr ? 1 : 0;
  }
  if (histogram == 0 || size == 0) {
    return;
  }
  size_t i = (size * 0x9E3779B97F4A7C15ull >> 52) & (kSizes - 1);
  for (size_t n = 0; n < kSizes; ++n, i = (i + 1) & (kSizes - 1)) {
    if (sizes[i].size == 0) { // a size not seen yet: its slot from now on
      sizes[i].size = size;
    }
    if (sizes[i].size == size) {
      sizes[i].count += delta;
      return;
    }
  }
}

__attribute__((constructor)) void read_trace_size() {
  if (const char* v = std::getenv("LIVE_BYTES_TRACE_SIZE")) {
    trace_size = std::strtoull(v, nullptr, 10);
  }
}

__attribute__((destructor)) void print_histogram() {
  if (histogram != 1) {
    return;
  }
  const int pid = static_cast<int>(getpid());
  FILE* out = stderr;
  if (const char* dir = std::getenv("LIVE_BYTES_DIR")) { // one file per process
    char path[4096];
    std::snprintf(path, sizeof(path), "%s/live_bytes.%d.txt", dir, pid);
    if (FILE* f = std::fopen(path, "w")) {
      out = f;
    } else {
      std::fprintf(stderr, "live_bytes: cannot write %s (%s); reporting here\n", path,
                   std::strerror(errno));
    }
  }
  for (const SizeCount& e : at_peak) {
    if (e.count != 0) {
      std::fprintf(out, "live_bytes at peak (pid %d): %zu x %lld\n", pid, e.size,
                   static_cast<long long>(e.count));
    }
  }
  for (const Traced& t : traced_at_peak) {
    if (t.ptr != 0) {
      std::fprintf(out, "live_bytes block of %zu bytes at peak (pid %d)%s\n", trace_size, pid,
                   t.depth == 0 ? ", its stack not taken yet" : ":");
      std::fflush(out); // backtrace_symbols_fd writes to the descriptor itself
      backtrace_symbols_fd(t.frames, t.depth, fileno(out));
    }
  }
  if (peak_depth > 0) {
    std::fprintf(out, "live_bytes peak stack (pid %d):\n", pid);
    std::fflush(out);
    backtrace_symbols_fd(peak_frames, peak_depth, fileno(out));
  }
  if (out != stderr) {
    std::fclose(out);
  }
}

size_t slot_of(uintptr_t p) {
  return static_cast<size_t>((p >> 4) * 0x9E3779B97F4A7C15ull >> 44) & (kSlots - 1);
}

void insert(uintptr_t p, size_t size) {
  bool new_peak = false;
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
    count_size(size, 1);
    if (live > peak) {
      peak = live;
      if (histogram == 1) {
        std::memcpy(at_peak, sizes, sizeof(sizes));
        std::memcpy(traced_at_peak, traced, sizeof(traced));
        new_peak = true;
      }
    }
  }
  int slot = -1; // a block to follow: its slot, taken under the lock
  if (trace_size != 0 && size == trace_size) {
    for (int k = 0; k < kTraced; ++k) {
      if (traced[k].ptr == 0) {
        traced[k].ptr = p;
        traced[k].depth = 0;
        slot = k;
        break;
      }
    }
  }
  pthread_mutex_unlock(&lock);
  // The stacks are taken outside the lock (backtrace may free on its first call) and stored
  // under it, if the block or the peak is still the one they belong to.
  static const bool with_stack = std::getenv("LIVE_BYTES_BACKTRACE") != nullptr;
  if (new_peak && with_stack) {
    void* frames[64];
    const int depth = backtrace(frames, 64);
    pthread_mutex_lock(&lock);
    std::memcpy(peak_frames, frames, sizeof(frames));
    peak_depth = depth;
    pthread_mutex_unlock(&lock);
  }
  if (slot >= 0) {
    void* frames[32];
    const int depth = backtrace(frames, 32);
    pthread_mutex_lock(&lock);
    if (traced[slot].ptr == p) {
      std::memcpy(traced[slot].frames, frames, sizeof(frames));
      traced[slot].depth = depth;
    }
    pthread_mutex_unlock(&lock);
  }
}

void erase(uintptr_t p) {
  pthread_mutex_lock(&lock);
  size_t i = slot_of(p);
  while (table[i].ptr != 0 && table[i].ptr != p) {
    i = (i + 1) & (kSlots - 1);
  }
  if (table[i].ptr == p) {
    if (trace_size != 0 && table[i].size == trace_size) {
      for (Traced& slot : traced) {
        if (slot.ptr == p) {
          slot.ptr = 0;
        }
      }
    }
    live -= static_cast<int64_t>(table[i].size);
    count_size(table[i].size, -1);
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
