/* This thread's index and its team's size inside a parallel region: 0 of 1 built without OpenMP. */
#ifndef TANDEM_OMP_TEAM_H
#define TANDEM_OMP_TEAM_H
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
static inline int64_t team_thread(void) { return omp_get_thread_num(); }
static inline int64_t team_size(void) { return omp_get_num_threads(); }
#else
static inline int64_t team_thread(void) { return 0; }
static inline int64_t team_size(void) { return 1; }
#endif
#endif
