// The exports of a hybrid layer's cold rows (host_tasks.h): a worker per plan, the CUDA stream's
// host functions that queue a task and wait for it, and ColdTask's layout for Python's check.

#include "host_tasks.h"

extern "C" {

// A worker for cold tasks: with its own thread (served 0), or run by pp_worker_serve's caller
// (served 1). Freed by pp_worker_free, which waits for a threaded worker's queued tasks.
void* pp_worker_new(int32_t served) { return new (std::nothrow) Worker(served != 0); }
void pp_worker_free(void* w) { delete (Worker*)w; }

// A served worker's next n tasks, run on the calling thread as they are submitted (one decode
// step's). Returns 0, PP_ERR_TIMEOUT when a task did not come in time, PP_ERR_ARG when the
// worker has its own thread.
int pp_worker_serve(void* w, int64_t n) {
  Worker* wk = (Worker*)w;
  return wk->served ? wk->serve(n) : PP_ERR_ARG;
}

// Host functions of a CUDA stream (cudaHostFn_t: void (*)(void*)): queue the task, and wait for
// it. Called in stream order by the driver's thread, or by the emulated stream.
void pp_host_submit(void* task) {
  ColdTask* t = (ColdTask*)task;
  ((Worker*)t->worker)->submit(t);
}
void pp_host_wait(void* task) {
  ColdTask* t = (ColdTask*)task;
  ((Worker*)t->worker)->wait(t);
}

// The task on the calling thread (tests; a device without host functions). Returns its status.
int pp_cold_run(void* task) {
  ColdTask* t = (ColdTask*)task;
  t->status = run_task(t);
  t->ran_on = (uint64_t)std::hash<std::thread::id>()(std::this_thread::get_id());
  t->state = TASK_DONE;
  return t->status;
}

// The byte offsets of ColdTask's fields, then its size (Python checks its own against them).
void pp_cold_task_layout(int64_t* out) {
  const int64_t v[] = {
      (int64_t)offsetof(ColdTask, worker), (int64_t)offsetof(ColdTask, rec),
      (int64_t)offsetof(ColdTask, x),      (int64_t)offsetof(ColdTask, mask),
      (int64_t)offsetof(ColdTask, cold),   (int64_t)offsetof(ColdTask, y),
      (int64_t)offsetof(ColdTask, kept),   (int64_t)offsetof(ColdTask, ids),
      (int64_t)offsetof(ColdTask, wts),    (int64_t)offsetof(ColdTask, T),
      (int64_t)offsetof(ColdTask, k),
      (int64_t)offsetof(ColdTask, act),    (int64_t)offsetof(ColdTask, nthreads),
      (int64_t)offsetof(ColdTask, status), (int64_t)offsetof(ColdTask, state),
      (int64_t)offsetof(ColdTask, ran_on), (int64_t)sizeof(ColdTask)};
  for (size_t i = 0; i < sizeof(v) / sizeof(v[0]); ++i) out[i] = v[i];
}

}  // extern "C"
