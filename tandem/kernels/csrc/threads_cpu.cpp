// Where the OpenMP threads of the calling thread's team run (tandem/utils/cpu_threads.py,
// "Placement"): bind_threads(cpus) starts a team of len(cpus) threads (PyTorch's OpenMP
// runtime: the threads every later region of this calling thread reuses, member i being the
// same thread each time) and binds member i to cpus[i], the calling thread being member 0.
// Returns each member's thread id, in member order: fewer than asked where the runtime gave
// fewer threads.

#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace tandem_cpu {

std::vector<int64_t> bind_threads(std::vector<int64_t> cpus) {
  const int n = static_cast<int>(cpus.size());
  TORCH_CHECK(n > 0, "bind_threads: no cpus");
  for (int64_t cpu : cpus) TORCH_CHECK(cpu >= 0 && cpu < CPU_SETSIZE, "bind_threads: cpu ", cpu, " out of range");
  std::vector<int64_t> tids(n, -1);
  int team = 0, failed = 0;
#pragma omp parallel num_threads(n)
  {
    const int i = omp_get_thread_num();
#pragma omp single
    team = omp_get_num_threads();
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpus[i]), &set);
    if (pthread_setaffinity_np(pthread_self(), sizeof(set), &set) != 0) {
#pragma omp atomic
      ++failed;
    }
    tids[i] = static_cast<int64_t>(syscall(SYS_gettid));
  }
  TORCH_CHECK(failed == 0, "bind_threads: the OS refused to bind ", failed, " thread(s)");
  tids.resize(team);
  return tids;
}

}  // namespace tandem_cpu

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("bind_threads(int[] cpus) -> int[]", &tandem_cpu::bind_threads);
}
