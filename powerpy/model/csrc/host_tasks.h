#pragma once
// A hybrid layer's cold FFN rows as a task that a CUDA stream hands to the host and waits for,
// inside a captured graph: the stream copies the layer's normed input and the predictor's mask
// into fixed pinned buffers, then calls pp_host_submit (cudaLaunchHostFunc), which only queues
// the task on a worker thread and returns; the GPU goes on with the hot rows; pp_host_wait, the
// stream's next host function, returns when the worker has written the cold rows' sum, which
// the stream then copies back and adds. No Python, no GIL and no CUDA call runs in either.
//
// A mixture of experts' layer (its record flagged LF_MOE) is the same task over its routed
// experts: the stream copies the router's choice (ids and weights, T x k) beside the input, and
// the worker sums each routed expert's cold neurons (moe_cold_rows).
//
// A Worker is a queue of tasks (pp_worker_new; the decode plan owns it), run in the order they
// were submitted, each with the kernels' thread team of task->nthreads, by one of:
// - its own thread (threaded): the emulated device, whose stream calls the host functions
//   inline on the thread that runs the step;
// - the thread that ran the step (served): on CUDA, once the step is queued (its graph
//   replayed), the caller runs pp_worker_serve, which runs the step's tasks as the driver's
//   thread submits them. The tasks then use the caller's OpenMP team, the one its other native
//   calls use: a second team would have as many threads as cores beside the first, and GNU
//   OpenMP throttles the spinning of idle team threads when its threads outnumber the cores,
//   so that every parallel region of a task would wake its team from sleep.
// A task that fails sets its status, and the step that read it raises; a wait that would
// outlast PP_TASK_TIMEOUT_MS returns with PP_ERR_TIMEOUT instead of hanging the stream, as does
// a serve whose tasks do not come.
//
// A hand-off through a condition variable costs a thread wake-up (tens of microseconds on a
// virtual machine). So the side that runs tasks polls its queue for PP_SPIN_WORKER_NS before it
// sleeps (the next layer's task comes after the device's attention and hot rows, while the cores
// are idle). A wait does not poll: while it waits the task's team has every core, and a task done
// before its wait (the device's hot rows took longer) is seen at once.
// tools/bench_host_tasks.py measures the hand-offs.

#include "blocks.h"

#include <atomic>
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
constexpr int64_t PP_SPIN_WORKER_NS = 1000000;  // the worker's poll for its next task
enum TaskState { TASK_IDLE = 0, TASK_QUEUED = 1, TASK_DONE = 2 };

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Poll done() for up to ns nanoseconds; true when it held.
template <class F>
inline bool poll_for(F done, int64_t ns) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::nanoseconds(ns);
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (done()) return true;
      cpu_relax();
    }
    if (std::chrono::steady_clock::now() >= end) return done();
  }
}

}  // namespace

extern "C" {

// Laid out as powerpy.model.host_tasks.ColdTask (checked at load: pp_cold_task_layout).
struct ColdTask {
  void* worker;           // the Worker that runs it
  const LayerRecord* rec; // the layer's record: its FFN half (gate, up, down, cut, variant)
  const float* x;         // (T, n_embd) the FFN's normed input
  const uint8_t* mask;    // (T, n_ff) the predictor's mask (nonzero: active), or null: every row
  const uint8_t* cold;    // (n_ff) nonzero where the row stays on the host (a mixture: per neuron
                          // of its n_expert * n_ff)
  float* y;               // (T, n_embd) the cold rows' sum, written by the task
  int64_t* kept;          // (T) rows added per token, or null
  const int64_t* ids;     // (T, k) a mixture's routed experts per token, largest weight first
  const float* wts;       // (T, k) their routing weights
  int64_t T;              // tokens (sessions) of the step
  int64_t k;              // experts per token (a mixture), else 0
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

// A mixture's cold task: for each token and each of its k routed experts e in routing order,
// the expert's cold neurons h_j = silu(gate_j . x) * (up_j . x) (its hot ones 0), the cut by
// groups of h weighted by w_e (cut_groups, over the cold members: the device scores the hot
// ones), y_e = (down_e . h) * w_e, and y = y_0 + y_1 + ...: moe_host.experts_host's steps with
// a cold mask. Plain SwiGLU experts without biases (moe.py moe_cold_part builds the record).
inline int moe_cold_rows(ColdTask* t) {
  const Layer L(t->rec);
  const Mat &gate = L.gate, &up = L.up, &down = L.down;
  const int64_t d = gate.cols, k = t->k;
  if (!(L.flags & LF_MOE) || d < 1 || k < 1 || !t->ids || !t->wts || down.nrows % d)
    return PP_ERR_ARG;
  const int64_t E = down.nrows / d;
  if (E < 1 || gate.nrows % E || up.nrows != gate.nrows || up.cols != d || is_x8(gate.dtype) ||
      gate.dtype != up.dtype)
    return PP_ERR_ARG;
  const int64_t ff = gate.nrows / E;
  if (down.cols != ff || (is_x8(down.dtype) && (d % 8 || !t->act))) return PP_ERR_ARG;
  int64_t* sel = (int64_t*)std::malloc(sizeof(int64_t) * ff);
  float* buf = (float*)std::malloc(sizeof(float) * (2 * ff + d));
  int st = sel && buf ? 0 : PP_ERR_ARG;
  float *hs = buf, *h = buf + ff, *ye = buf + 2 * ff;
  for (int64_t i = 0; i < t->T && !st; ++i) {
    const float* x = t->x + i * d;
    float* acc = t->y + i * d;
    int64_t kept = 0;
    for (int64_t s = 0; s < k && !st; ++s) {
      const int64_t e = t->ids[i * k + s];
      const float w = t->wts[i * k + s];
      if (e < 0 || e >= E) {
        st = PP_ERR_ARG;
        break;
      }
      float* y = s ? ye : acc;
      int64_t n = 0;
      for (int64_t j = 0; j < ff; ++j)
        if (t->cold[e * ff + j]) sel[n++] = e * ff + j;
      if (!n) {  // every neuron of e is on the device: nothing of it here
        for (int64_t j = 0; j < d; ++j) y[j] = 0.0f;
      } else {
        st = mat_glu(gate, up, x, sel, n, V_SWIGLU, hs, t->act, t->nthreads);
        for (int64_t j = 0; j < ff; ++j) h[j] = 0.0f;
        for (int64_t m = 0; m < n; ++m) h[sel[m] - e * ff] = hs[m];
        if (L.tau) cut_groups(h, ff, cut_group(down.dtype), w, L.tau + e * ff, nullptr);
        for (int64_t j = 0; j < ff; ++j) kept += h[j] != 0.0f;
        if (!st && is_x8(down.dtype))
          st = x8_experts(down.dtype, down.w, down.ld, d, ff, &e, 1, h, ff, y, t->act,
                          t->nthreads);
        else if (!st)
          st = mat_gemv(sub_rows(down, e * d, d), h, nullptr, d, y, t->act, t->nthreads);
      }
      for (int64_t j = 0; j < d; ++j) y[j] *= w;  // weighted, then added in routing order
      if (s)
        for (int64_t j = 0; j < d; ++j) acc[j] += y[j];
    }
    if (t->kept) t->kept[i] = kept;
  }
  std::free(sel);
  std::free(buf);
  return st;
}

inline int run_task(ColdTask* t) { return t->k ? moe_cold_rows(t) : cold_rows(t); }

struct Worker {
  std::mutex m;
  std::condition_variable queued, done;
  std::deque<ColdTask*> q;
  std::atomic<int64_t> n_queued{0};  // q.size(), read without the lock by the polls
  std::atomic<bool> stop{false};
  const bool served;  // pp_worker_serve runs the tasks, on its caller's thread
  std::thread th;

  explicit Worker(bool served_) : served(served_) {
    if (!served) th = std::thread([this] { loop(); });
  }
  ~Worker() {
    {
      std::lock_guard<std::mutex> g(m);
      stop.store(true);
    }
    queued.notify_all();
    if (th.joinable()) th.join();
  }
  // The next queued task, after a poll of poll_ns; null when stopped or after timeout_ms
  // (negative: none).
  ColdTask* next(int64_t poll_ns, int64_t timeout_ms) {
    if (poll_ns > 0)
      poll_for([&] { return n_queued.load(std::memory_order_acquire) > 0 || stop.load(); },
               poll_ns);
    std::unique_lock<std::mutex> g(m);
    const auto ready = [&] { return stop.load() || !q.empty(); };
    if (timeout_ms < 0)
      queued.wait(g, ready);
    else if (!queued.wait_for(g, std::chrono::milliseconds(timeout_ms), ready))
      return nullptr;
    if (q.empty()) return nullptr;
    ColdTask* t = q.front();
    q.pop_front();
    n_queued.fetch_sub(1, std::memory_order_relaxed);
    return t;
  }
  void run(ColdTask* t, uint64_t me) {
    const int st = run_task(t);
    {
      std::lock_guard<std::mutex> g(m);
      t->status = st;
      t->ran_on = me;
      t->state = TASK_DONE;
    }
    done.notify_all();
  }
  void loop() {
    const uint64_t me = (uint64_t)std::hash<std::thread::id>()(std::this_thread::get_id());
    for (int64_t poll = 0;; poll = PP_SPIN_WORKER_NS) {  // polls once a task has run
      ColdTask* t = next(poll, -1);
      if (!t) return;
      run(t, me);
    }
  }
  // Run the next n tasks on the calling thread (a served worker); 0, or PP_ERR_TIMEOUT when one
  // did not come within PP_TASK_TIMEOUT_MS.
  int serve(int64_t n) {
    const uint64_t me = (uint64_t)std::hash<std::thread::id>()(std::this_thread::get_id());
    for (int64_t i = 0; i < n; ++i) {
      ColdTask* t = next(PP_SPIN_WORKER_NS, PP_TASK_TIMEOUT_MS);
      if (!t) return PP_ERR_TIMEOUT;
      run(t, me);
    }
    return 0;
  }
  void submit(ColdTask* t) {
    {
      std::lock_guard<std::mutex> g(m);
      t->status = 0;
      t->state = TASK_QUEUED;
      q.push_back(t);
      n_queued.fetch_add(1, std::memory_order_release);
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
