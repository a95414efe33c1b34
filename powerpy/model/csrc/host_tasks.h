// A hybrid layer's cold FFN rows as a task that a CUDA stream hands to the host and waits for,
// inside a captured graph: the stream copies the layer's normed input and the predictor's mask
// into fixed pinned buffers, then calls pp_host_submit (cudaLaunchHostFunc), which only queues
// the task on a worker thread and returns; the GPU goes on with the hot rows; pp_host_wait, the
// stream's next host function, returns when the worker has written the cold rows' sum, which
// the stream then copies back and adds. No Python, no GIL and no CUDA call runs in either.
//
// A Worker is one thread with a queue (pp_worker_new; the decode plan owns it), which runs each
// task's rows with the kernels' thread team of task->nthreads. Tasks run in the order they were
// submitted. A task that fails sets its status, and the step that read it raises; a wait that
// would outlast PP_TASK_TIMEOUT_MS returns with PP_ERR_TIMEOUT instead of hanging the stream.

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <new>
#include <thread>

namespace {

constexpr int PP_ERR_TIMEOUT = 7;
constexpr int64_t PP_TASK_TIMEOUT_MS = 60000;
enum TaskState { TASK_IDLE = 0, TASK_QUEUED = 1, TASK_DONE = 2 };

}  // namespace

extern "C" {

// Laid out as powerpy.model.host_tasks.ColdTask (checked at load: pp_cold_task_layout).
struct ColdTask {
  void* worker;           // the Worker that runs it
  const int64_t* rec;     // the layer's record: its FFN half (gate, up, down, cut, variant)
  const float* x;         // (T, n_embd) the FFN's normed input
  const uint8_t* mask;    // (T, n_ff) the predictor's mask (nonzero: active), or null: every row
  const uint8_t* cold;    // (n_ff) nonzero where the row stays on the host
  float* y;               // (T, n_embd) the cold rows' sum, written by the task
  int64_t* kept;          // (T) rows added per token, or null
  int64_t T;              // tokens (sessions) of the step
  int32_t act;            // llama.cpp's rounding of quantized matmuls' activations
  int32_t nthreads;       // the task's thread team
  int32_t status;         // 0, or the first error of its last run
  int32_t state;          // TaskState
  uint64_t ran_on;        // a hash of the id of the thread that ran it last (tests)
};

}  // extern "C"

namespace {

// The cold rows of every token of a task: the rows cold and (with a mask) predicted, in order.
inline int cold_rows(ColdTask* t) {
  const Layer L(t->rec);
  if (!ffn_layout_ok(L) || (L.flags & (LF_DOWN_STORED | LF_MOE))) return PP_ERR_ARG;
  const int64_t n_ff = L.up.nrows, d = L.up.cols;
  int64_t* sel = (int64_t*)std::malloc(sizeof(int64_t) * (n_ff > 0 ? n_ff : 1));
  float* h = (float*)std::malloc(sizeof(float) * (n_ff > 0 ? n_ff : 1));
  int st = sel && h ? 0 : PP_ERR_ARG;
  for (int64_t i = 0; i < t->T && !st; ++i) {
    const uint8_t* m = t->mask ? t->mask + i * n_ff : nullptr;
    int64_t k = 0;
    for (int64_t j = 0; j < n_ff; ++j)
      if (t->cold[j] && (!m || m[j])) sel[k++] = j;
    int64_t kept = 0;
    st = ffn_rows(L, t->x + i * d, sel, k, h, t->y + i * d, t->act, t->nthreads, &kept);
    if (t->kept) t->kept[i] = kept;
  }
  std::free(sel);
  std::free(h);
  return st;
}

struct Worker {
  std::mutex m;
  std::condition_variable queued, done;
  std::deque<ColdTask*> q;
  bool stop = false;
  std::thread th;

  Worker() : th([this] { loop(); }) {}
  ~Worker() {
    {
      std::lock_guard<std::mutex> g(m);
      stop = true;
    }
    queued.notify_all();
    th.join();
  }
  void loop() {
    const uint64_t me = (uint64_t)std::hash<std::thread::id>()(std::this_thread::get_id());
    for (;;) {
      ColdTask* t;
      {
        std::unique_lock<std::mutex> g(m);
        queued.wait(g, [&] { return stop || !q.empty(); });
        if (q.empty()) return;
        t = q.front();
        q.pop_front();
      }
      const int st = cold_rows(t);
      {
        std::lock_guard<std::mutex> g(m);
        t->status = st;
        t->ran_on = me;
        t->state = TASK_DONE;
      }
      done.notify_all();
    }
  }
  void submit(ColdTask* t) {
    {
      std::lock_guard<std::mutex> g(m);
      t->state = TASK_QUEUED;
      t->status = 0;
      q.push_back(t);
    }
    queued.notify_one();
  }
  void wait(ColdTask* t) {
    std::unique_lock<std::mutex> g(m);
    const bool ok = done.wait_for(g, std::chrono::milliseconds(PP_TASK_TIMEOUT_MS),
                                  [&] { return t->state != TASK_QUEUED; });
    if (!ok) t->status = PP_ERR_TIMEOUT;
  }
};

}  // namespace

extern "C" {

// A worker thread for cold tasks (freed by pp_worker_free, which waits for the queued ones).
void* pp_worker_new(void) { return new (std::nothrow) Worker(); }
void pp_worker_free(void* w) { delete (Worker*)w; }

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
  t->status = cold_rows(t);
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
      (int64_t)offsetof(ColdTask, kept),   (int64_t)offsetof(ColdTask, T),
      (int64_t)offsetof(ColdTask, act),    (int64_t)offsetof(ColdTask, nthreads),
      (int64_t)offsetof(ColdTask, status), (int64_t)offsetof(ColdTask, state),
      (int64_t)offsetof(ColdTask, ran_on), (int64_t)sizeof(ColdTask)};
  for (size_t i = 0; i < sizeof(v) / sizeof(v[0]); ++i) out[i] = v[i];
}

}  // extern "C"
