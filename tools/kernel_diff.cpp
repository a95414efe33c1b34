// Two builds of the native kernels compared bit for bit: every export of library A and of
// library B gets the same random inputs (all dtypes, shapes with and without tails, gathered and
// bad indices, f32 and quantized activations, 1 and 3 threads, token counts that reach every GEMM
// tile, both KV cache types, every layout of the decode blocks' layer record), and each output,
// status and cache write must be the same bytes (the decode blocks, given valid records, must
// also succeed).
// Driven by tools/kernel_diff.sh; by hand: g++ -O1 -std=c++17 tools/kernel_diff.cpp -ldl, then
// ./a.out A.so B.so [quick]. Exit status 0 when everything matched.
#include <dlfcn.h>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <random>
#include <vector>
#include <string>
#include <map>
#include <cstdlib>
#include <algorithm>

typedef int (*gemv_t)(int, const void*, int64_t, int64_t, int64_t, const float*, const int64_t*, int64_t, float*, int, int);
typedef int (*axpy_t)(int, const void*, int64_t, int64_t, int64_t, const float*, const int64_t*, int64_t, float*, int, int);
typedef int (*glu_t)(int, const void*, int64_t, const void*, int64_t, int64_t, int64_t, const float*, const int64_t*, int64_t, int, float*, int, int);
typedef int (*gemm_t)(int, const void*, int64_t, int64_t, int64_t, const float*, int64_t, int64_t, float*, int64_t, const uint8_t*, int, int);
typedef int (*deq_t)(int, const void*, int64_t, int64_t, int64_t, const int64_t*, int64_t, float*, int);
typedef int (*attn_dec_t)(const int64_t*, int64_t, int64_t, int64_t, int64_t, float, const float*, const float*, void*, void*, int, int64_t, float*, int, int);
typedef int64_t (*ffn_dec_t)(const int64_t*, float, float, const float*, const float*, float*, int, int);
typedef int (*layers_t)(int64_t, const int64_t*, const int64_t*, int64_t, int64_t, int64_t, int64_t, float, void*, void*, int64_t, int, int64_t, float, float*, int64_t*, int, int);
// ABI 18 on: pp_decode_layers takes the phase clock (phases, n_phases) before act
typedef int (*layers18_t)(int64_t, const int64_t*, const int64_t*, int64_t, int64_t, int64_t, int64_t, float, void*, void*, int64_t, int, int64_t, float, float*, int64_t*, double*, int64_t, int, int);
typedef void (*ropet_t)(const int64_t*, int64_t, int64_t, float, float*);
typedef void (*rope_t)(float*, int64_t, int64_t, int64_t, int64_t, const float*, int);
typedef int (*attn_t)(const float*, const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t, int64_t, int64_t, float*, int);
// the heads' sinks (null here) before out since the GPT-OSS ABI
typedef int (*attn_ext_t)(const float*, const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t, int64_t, int64_t, float, int, float, int64_t, const float*, float*, int);
typedef void (*gelut_t)(uint16_t*);
typedef void (*softcap_t)(float*, int64_t, float);
typedef void (*rms_t)(const float*, const float*, int64_t, int64_t, float, float*, int);
typedef void (*lnorm_t)(const float*, const float*, const float*, int64_t, int64_t, float, float*, int);
typedef void (*gelu_t)(const float*, int64_t, float*, int, int);
typedef void (*swiglu_t)(const float*, const float*, int64_t, float*, int);
typedef void (*tune_t)(int64_t, int64_t);
typedef double (*stream_t)(const void*, int64_t, int);
typedef int (*simd_t)(void);

struct Lib {
  void* h;
  gemv_t gemv; axpy_t axpy; glu_t glu; gemm_t gemm; deq_t deq; attn_dec_t attn_dec; ffn_dec_t ffn_dec;
  layers_t layers; ropet_t ropet; rope_t rope; attn_t attn; rms_t rms; swiglu_t swiglu; tune_t tune;
  stream_t stream; simd_t simd; lnorm_t lnorm; gelu_t gelu; attn_ext_t attn_ext; gelut_t gelut;
  softcap_t softcap; simd_t rec_len; simd_t abi;
  // one decode step through n layers, in either ABI's signature (a clock where it takes one)
  int decode_layers(int64_t n, const int64_t* recs, const int64_t* rots, int64_t n_head, int64_t n_kv,
                    int64_t hd, float eps, void* k, void* v, int64_t lb, int cdt, int64_t pos, float* x,
                    int64_t* counts, int act, int nt) {
    if (abi() < 18) return layers(n, recs, rots, n_head, n_kv, hd, hd, eps, k, v, lb, cdt, pos, 0.0f, x, counts, act, nt);
    double clock[5] = {0};
    return ((layers18_t)layers)(n, recs, rots, n_head, n_kv, hd, hd, eps, k, v, lb, cdt, pos, 0.0f, x, counts, clock, 5, act, nt);
  }
  explicit Lib(const char* path) {
    h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) { fprintf(stderr, "%s\n", dlerror()); exit(2); }
#define S(v, n) v = (decltype(v))dlsym(h, n); if (!v) { fprintf(stderr, "missing %s\n", n); exit(2); }
    S(gemv, "pp_gather_gemv") S(axpy, "pp_gather_axpy") S(glu, "pp_glu_gemv") S(gemm, "pp_gemm")
    S(deq, "pp_dequant_rows") S(attn_dec, "pp_attn_decode") S(ffn_dec, "pp_ffn_decode")
    S(layers, "pp_decode_layers") S(ropet, "pp_rope_table") S(rope, "pp_rope") S(attn, "pp_attn")
    S(rms, "pp_rms_norm") S(swiglu, "pp_swiglu") S(stream, "pp_stream_read")
    S(simd, "pp_simd_level") S(lnorm, "pp_layer_norm") S(gelu, "pp_gelu") S(attn_ext, "pp_attn_ext")
    S(gelut, "pp_gelu_table") S(softcap, "pp_softcap") S(rec_len, "pp_layer_record_len")
    S(abi, "pp_abi_version")
    tune = (tune_t)dlsym(h, "pp_set_tuning");  // gone in ABI 27 (the prefetch reach is a -D)
  }
};

static std::mt19937_64 rng(1234);
static float randn(float s = 1.0f) { std::normal_distribution<float> d(0.0f, s); return d(rng); }

static int rint_(int n) { return (int)(rng() % (uint64_t)n); }

// type sizes: (block elements, block bytes)
static const int QK[11] = {1, 1, 1, 32, 32, 32, 32, 32, 256, 256, 256};
static const int TS[11] = {4, 2, 2, 34, 18, 20, 22, 24, 144, 176, 210};

struct Matx { int dt; std::vector<uint8_t> buf; int64_t ld, nrows, cols; };

// float -> f16 bits for test data (small normal values; truncating is fine here)
static uint16_t half_of(float f) {
  uint32_t x; memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000; int e = ((x >> 23) & 0xff) - 127 + 15; uint32_t m = (x >> 13) & 0x3ff;
  if (e <= 0) return (uint16_t)sign; if (e >= 31) return (uint16_t)(sign | 0x7bff);
  return (uint16_t)(sign | (e << 10) | m);
}

static Matx make(int dt, int64_t nrows, int64_t cols, int pad = 0) {
  Matx m{dt, {}, 0, nrows, cols};
  const int64_t rb = cols / QK[dt] * TS[dt];
  m.ld = rb + pad;
  m.buf.resize(m.ld * nrows + 64);
  for (auto& b : m.buf) b = (uint8_t)rng();
  for (int64_t r = 0; r < nrows; ++r) {
    uint8_t* row = m.buf.data() + r * m.ld;
    if (dt == 0) for (int64_t i = 0; i < cols; ++i) { float f = randn(0.1f); memcpy(row + 4 * i, &f, 4); }
    else if (dt == 1) for (int64_t i = 0; i < cols; ++i) { uint16_t h = half_of(randn(0.1f)); memcpy(row + 2 * i, &h, 2); }
    else if (dt == 2) for (int64_t i = 0; i < cols; ++i) { float f = randn(0.1f); uint32_t u; memcpy(&u, &f, 4); uint16_t h = u >> 16; memcpy(row + 2 * i, &h, 2); }
    else {
      for (int64_t b = 0; b < cols / QK[dt]; ++b) {
        uint8_t* p = row + b * TS[dt];
        auto seth = [&](int off, float v) { uint16_t h = half_of(v); memcpy(p + off, &h, 2); };
        float d = 0.001f + 0.01f * (rng() % 1000) / 1000.0f;
        if (dt == 10) seth(208, d);
        else { seth(0, d); if (dt == 5 || dt == 7 || dt == 8 || dt == 9) seth(2, (dt >= 8 ? 1.0f : -1.0f) * 0.005f * (rng() % 1000) / 1000.0f); }
      }
    }
  }
  return m;
}

static std::vector<float> vecn(int64_t n, float s = 1.0f) { std::vector<float> v(n); for (auto& x : v) x = randn(s); return v; }

static std::map<std::string, int> fails, runs;
static bool same(const void* a, const void* b, size_t n) { return memcmp(a, b, n) == 0; }
static void check(const std::string& name, bool ok, const std::string& what) {
  runs[name]++;
  if (!ok) { if (fails[name] < 20) fprintf(stderr, "MISMATCH %s: %s\n", name.c_str(), what.c_str()); fails[name]++; }
}

int main(int argc, char** argv) {
  Lib A(argv[1]), B(argv[2]);
  const bool quick = argc > 3;
  printf("simd A %d B %d\n", A.simd(), B.simd());
  for (Lib* L : {&A, &B}) if (L->tune) L->tune(-1, 1);  // threads even on tiny matrices
  const int thr_opts[2] = {1, 3};
  for (int dt = 0; dt < 11; ++dt) {
    std::vector<int64_t> colsv;
    if (dt <= 2) colsv = {64, 100, 1000, 2048};
    else if (QK[dt] == 32) colsv = {32, 96, 160, 512, 2048};
    else colsv = {256, 768, 2048};
    for (int64_t cols : colsv) {
      for (int64_t nrows : {1, 7, 37}) {
        Matx m = make(dt, nrows, cols, rint_(2) * 16);
        Matx m2 = make(dt, nrows, cols, 0);
        char tag[128];
        for (int act = 0; act < 2; ++act)
          for (int nt : thr_opts) {
            snprintf(tag, sizeof tag, "dt=%d cols=%ld nrows=%ld act=%d nt=%d", dt, (long)cols, (long)nrows, act, nt);
            auto x = vecn(cols);
            // gemv: all rows and a gathered list (one bad index sometimes)
            for (int mode = 0; mode < 3; ++mode) {
              std::vector<int64_t> idx;
              int64_t k = nrows;
              if (mode) { k = 1 + rint_(2 * nrows); for (int64_t j = 0; j < k; ++j) idx.push_back(rint_(nrows)); if (mode == 2) idx[rint_(k)] = nrows + 5; }
              std::vector<float> oa(k, 7.0f), ob(k, 7.0f);
              int sa = A.gemv(dt, m.buf.data(), m.ld, nrows, cols, x.data(), mode ? idx.data() : nullptr, k, oa.data(), act, nt);
              int sb = B.gemv(dt, m.buf.data(), m.ld, nrows, cols, x.data(), mode ? idx.data() : nullptr, k, ob.data(), act, nt);
              check("gemv", sa == sb && same(oa.data(), ob.data(), 4 * k), tag);
              // glu
              for (int v = 0; v < 4; ++v) {
                std::vector<float> ga(k, 7.0f), gb(k, 7.0f);
                sa = A.glu(dt, m.buf.data(), m.ld, m2.buf.data(), m2.ld, nrows, cols, x.data(), mode ? idx.data() : nullptr, k, v, ga.data(), act, nt);
                sb = B.glu(dt, m.buf.data(), m.ld, m2.buf.data(), m2.ld, nrows, cols, x.data(), mode ? idx.data() : nullptr, k, v, gb.data(), act, nt);
                check("glu", sa == sb && same(ga.data(), gb.data(), 4 * k), tag);
              }
              if (act == 0) {
                // axpy (act-independent): h with zeros
                std::vector<float> h = vecn(k);
                for (auto& hv : h) if (rint_(4) == 0) hv = 0.0f;
                for (int accum = 0; accum < 2; ++accum) {
                  std::vector<float> aa = vecn(cols), ab = aa;
                  sa = A.axpy(dt, m.buf.data(), m.ld, nrows, cols, h.data(), mode ? idx.data() : nullptr, k, aa.data(), accum, nt);
                  sb = B.axpy(dt, m.buf.data(), m.ld, nrows, cols, h.data(), mode ? idx.data() : nullptr, k, ab.data(), accum, nt);
                  check("axpy", sa == sb && same(aa.data(), ab.data(), 4 * cols), tag);
                }
                std::vector<float> da(k * cols, 7.0f), db(k * cols, 7.0f);
                sa = A.deq(dt, m.buf.data(), m.ld, nrows, cols, mode ? idx.data() : nullptr, k, da.data(), nt);
                sb = B.deq(dt, m.buf.data(), m.ld, nrows, cols, mode ? idx.data() : nullptr, k, db.data(), nt);
                check("dequant", sa == sb && same(da.data(), db.data(), 4 * k * cols), tag);
              }
            }
            // gemm over token counts
            std::vector<int64_t> Ts = quick ? std::vector<int64_t>{2, 5, 7, 9, 16, 33} : std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 13, 16, 17, 31, 33, 40, 70};
            for (int64_t T : Ts) {
              const int64_t ldx = cols + 4, ldo = nrows + 3;
              auto X = vecn(T * ldx);
              for (int needm = 0; needm < 2; ++needm) {
                std::vector<uint8_t> need(T * nrows);
                for (auto& n : need) n = rint_(3) == 0;
                std::vector<float> oa(T * ldo, 7.0f), ob(T * ldo, 7.0f);
                int sa = A.gemm(dt, m.buf.data(), m.ld, nrows, cols, X.data(), ldx, T, oa.data(), ldo, needm ? need.data() : nullptr, act, nt);
                int sb = B.gemm(dt, m.buf.data(), m.ld, nrows, cols, X.data(), ldx, T, ob.data(), ldo, needm ? need.data() : nullptr, act, nt);
                snprintf(tag, sizeof tag, "dt=%d cols=%ld nrows=%ld act=%d nt=%d T=%ld need=%d", dt, (long)cols, (long)nrows, act, nt, (long)T, needm);
                check("gemm", sa == sb && same(oa.data(), ob.data(), 4 * T * ldo), tag);
              }
            }
          }
      }
    }
  }
  // ---- float numerics
  for (int64_t hd : {32, 40, 48, 64, 80, 96, 128}) {
    for (int64_t T : {1, 2, 3, 7, 16, 20}) {
      for (int64_t p0 : {0, 5, 17, 40}) {
        const int64_t n_head = 4, n_kv = 2, S = p0 + T;
        std::vector<float> q = vecn(T * n_head * hd);
        std::vector<uint16_t> kc(S * n_kv * hd), vc(S * n_kv * hd);
        for (auto& v : kc) v = half_of(randn(0.5f));
        for (auto& v : vc) v = half_of(randn(0.5f));
        for (int nt : thr_opts)
          for (int o = 0; o < 5; ++o) {  // plain; ext: default, soft-cap and window, q scaled, a scale
            const float scale = o == 4 ? 0.3f : 0.0f, cap = o == 2 ? 3.0f : 0.0f;
            const int64_t window = o == 2 ? 6 : 0;
            std::vector<float> oa(T * n_head * hd, 7.0f), ob(T * n_head * hd, 7.0f);
            int sa, sb;
            if (o == 0) {
              sa = A.attn(q.data(), kc.data(), vc.data(), p0, T, n_head, n_kv, hd, oa.data(), nt);
              sb = B.attn(q.data(), kc.data(), vc.data(), p0, T, n_head, n_kv, hd, ob.data(), nt);
            } else {
              sa = A.attn_ext(q.data(), kc.data(), vc.data(), p0, T, n_head, n_kv, hd, scale, o == 3, cap, window, nullptr, oa.data(), nt);
              sb = B.attn_ext(q.data(), kc.data(), vc.data(), p0, T, n_head, n_kv, hd, scale, o == 3, cap, window, nullptr, ob.data(), nt);
            }
            char tag[96]; snprintf(tag, sizeof tag, "hd=%ld T=%ld p0=%ld nt=%d o=%d", (long)hd, (long)T, (long)p0, nt, o);
            check("attn", sa == 0 && sa == sb && same(oa.data(), ob.data(), 4 * oa.size()), tag);
          }
      }
    }
  }
  for (int64_t n : {1, 15, 16, 17, 100, 1000, 4099}) {
    auto g = vecn(n, 4.0f), u = vecn(n);
    if (n > 20) { g[3] = 100.0f; g[4] = -100.0f; g[5] = 200.0f; g[6] = -200.0f; }
    std::vector<float> oa(n), ob(n);
    A.swiglu(g.data(), u.data(), n, oa.data(), 2);
    B.swiglu(g.data(), u.data(), n, ob.data(), 2);
    check("swiglu", same(oa.data(), ob.data(), 4 * n), std::to_string(n));
    auto w = vecn(n);
    std::vector<float> ra(3 * n), rb(3 * n);
    auto xx = vecn(3 * n);
    A.rms(xx.data(), w.data(), 3, n, 1e-5f, ra.data(), 2);
    B.rms(xx.data(), w.data(), 3, n, 1e-5f, rb.data(), 2);
    check("rms_norm", same(ra.data(), rb.data(), 4 * 3 * n), std::to_string(n));
    auto bias = vecn(n, 0.1f);
    for (int wb = 0; wb < 2; ++wb) {
      A.lnorm(xx.data(), w.data(), wb ? bias.data() : nullptr, 3, n, 1e-5f, ra.data(), 2);
      B.lnorm(xx.data(), w.data(), wb ? bias.data() : nullptr, 3, n, 1e-5f, rb.data(), 2);
      check("layer_norm", same(ra.data(), rb.data(), 4 * 3 * n), std::to_string(n));
    }
    for (int act = 0; act < 2; ++act) {
      A.gelu(g.data(), n, oa.data(), act, 2);
      B.gelu(g.data(), n, ob.data(), act, 2);
      check("gelu", same(oa.data(), ob.data(), 4 * n), std::to_string(n));
    }
    std::vector<float> ca = g, cb = g;
    A.softcap(ca.data(), n, 3.0f);
    B.softcap(cb.data(), n, 3.0f);
    check("softcap", same(ca.data(), cb.data(), 4 * n), std::to_string(n));
  }
  {
    std::vector<int64_t> pos = {0, 1, 7, 100, 5000};
    std::vector<float> ta(5 * 32 * 2), tb(5 * 32 * 2);
    A.ropet(pos.data(), 5, 64, 10000.0f, ta.data());
    B.ropet(pos.data(), 5, 64, 10000.0f, tb.data());
    check("rope_table", same(ta.data(), tb.data(), 4 * ta.size()), "");
    auto x = vecn(5 * 4 * 80), y = x;
    for (int neox = 0; neox < 2; ++neox) {
      A.rope(x.data(), 5, 4, 80, 64, ta.data(), neox);
      B.rope(y.data(), 5, 4, 80, 64, ta.data(), neox);
      check("rope", same(x.data(), y.data(), 4 * x.size()), "");
    }
    std::vector<uint16_t> ga(65536), gb(65536);
    A.gelut(ga.data());
    B.gelut(gb.data());
    check("gelu_table", ga == gb, "");
    std::vector<float> buf = vecn(1 << 16);
    double a = A.stream(buf.data(), 4 << 16, 2), b = B.stream(buf.data(), 4 << 16, 2);
    check("stream_read", a == b, "");
  }
  // ---- fused decode blocks, one layer record per layout (csrc/layer_record.h LayerRecord)
  // The record as int64 slots, for a library of any revision: each is a LayerRecord field's byte
  // offset / 8 (the same bytes since the record was first a list of int64 slots); R_LEN: room for
  // any ABI's record (111 int64 since GPT-OSS; the slots past 65 stay zero).
  enum { R_ATTN_NORM = 45, R_FFN_NORM = 47, R_POST = 49, R_QK = 51, R_BIAS = 53, R_TAU = 59,
         R_FLAGS = 60, R_VARIANT = 61, R_WINDOW = 62, R_SCALE = 63, R_SOFTCAP = 64, R_LEN = 128 };
  enum { F_LN = 1, F_ROPE = 2, F_NEOX = 4, F_PAR = 8, F_DS = 16, F_QS = 32 };
  auto bits = [](float f) { uint32_t u; memcpy(&u, &f, 4); return (int64_t)u; };
  auto P = [](const void* p) { return (int64_t)(intptr_t)p; };
  const int dts[] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  for (int dt : dts) {
    const bool kq = QK[dt] == 256;  // K-quants: every row a multiple of 256 (W_o's too)
    const int64_t d = kq ? 256 : 128, n_head = 4, n_kv = 2, hd = kq ? 64 : 32, n_ff = kq ? 512 : 96, H = 32;
    Matx wq = make(dt, n_head * hd, d), wk = make(dt, n_kv * hd, d), wv = make(dt, n_kv * hd, d), wo = make(dt, d, n_head * hd);
    Matx fc1 = make(0, H, d), fc2 = make(0, n_ff, H), gate = make(dt, n_ff, d), up = make(dt, n_ff, d), down = make(dt, n_ff, d);
    Matx downs = make(dt, d, n_ff);
    auto pk = [](int64_t* v, const Matx* m) {
      if (!m) return;
      v[0] = m->dt; v[1] = (int64_t)(intptr_t)m->buf.data(); v[2] = m->ld; v[3] = m->nrows; v[4] = m->cols;
    };
    auto norm1 = vecn(d, 0.5f), norm2 = vecn(d, 0.5f), tau = vecn(n_ff, 0.01f), b1 = vecn(d, 0.1f);
    auto b2 = vecn(d, 0.1f), post1 = vecn(d, 0.5f), post2 = vecn(d, 0.5f), qn = vecn(hd, 0.5f), kn = vecn(hd, 0.5f);
    auto bq = vecn(n_head * hd, 0.1f), bk = vecn(n_kv * hd, 0.1f), bv = vecn(n_kv * hd, 0.1f), bu = vecn(n_ff, 0.1f);
    for (auto& t : tau) t = std::fabs(t);
    std::vector<float> rot(hd);
    for (int64_t i = 0; i < hd / 2; ++i) { rot[2 * i] = std::cos(0.3f * i); rot[2 * i + 1] = std::sin(0.3f * i); }
    // layouts: 0 llama, 1 falcon (LayerNorm, NEOX, parallel, biases, ungated), 2 gemma (post and
    // q/k norms, q scaled, soft-cap, window, GeGLU), 3 opt (LayerNorm, no RoPE, biases, ReLU)
    for (int lay = 0; lay < 4; ++lay) {
      auto record = [&](bool pred, bool withtau, bool ds, int v, int64_t* r) {
        for (int i = 0; i < R_LEN; ++i) r[i] = 0;
        pk(r, &wq); pk(r + 5, &wk); pk(r + 10, &wv); pk(r + 15, &wo);
        pk(r + 20, pred ? &fc1 : nullptr); pk(r + 25, pred ? &fc2 : nullptr);
        pk(r + 30, lay == 0 || lay == 2 ? &gate : nullptr); pk(r + 35, &up); pk(r + 40, ds ? &downs : &down);
        r[R_ATTN_NORM] = P(norm1.data()); r[R_FFN_NORM] = P(norm2.data()); r[R_TAU] = withtau ? P(tau.data()) : 0;
        r[R_VARIANT] = v; r[R_SCALE] = bits(1.0f / std::sqrt((float)hd));
        r[R_FLAGS] = (lay == 3 ? 0 : F_ROPE) | (ds ? F_DS : 0);
        if (lay == 1 || lay == 3) {
          r[R_FLAGS] |= F_LN | (lay == 1 ? F_NEOX | F_PAR : 0);
          r[R_ATTN_NORM + 1] = P(b1.data()); r[R_FFN_NORM + 1] = P(b2.data());
          r[R_BIAS] = P(bq.data()); r[R_BIAS + 1] = P(bk.data()); r[R_BIAS + 2] = P(bv.data());
          r[R_BIAS + 3] = P(b1.data()); r[R_BIAS + 4] = P(bu.data()); r[R_BIAS + 5] = P(b2.data());
        }
        if (lay == 2) {
          r[R_FLAGS] |= F_NEOX | F_QS;
          r[R_POST] = P(post1.data()); r[R_POST + 1] = P(post2.data()); r[R_QK] = P(qn.data()); r[R_QK + 1] = P(kn.data());
          r[R_WINDOW] = 7; r[R_SOFTCAP] = bits(3.0f);
        }
      };
      const std::vector<int> variants = lay == 0 ? std::vector<int>{0, 1, 2} : lay == 2 ? std::vector<int>{3} : std::vector<int>{4, 5};
      const float* rp = lay == 3 ? nullptr : rot.data();
      for (int act = 0; act < 2; ++act)
        for (int cdt = 0; cdt < 2; ++cdt)
          for (int64_t pos : {0, 9, 40})
            for (int nt : thr_opts) {
              char tag[128]; snprintf(tag, sizeof tag, "dt=%d layout=%d act=%d cdt=%d pos=%ld nt=%d", dt, lay, act, cdt, (long)pos, nt);
              std::vector<int64_t> am(R_LEN);
              record(false, false, false, variants[0], am.data());
              const size_t es = cdt ? 2 : 4;
              std::vector<uint8_t> kca((pos + 1) * n_kv * hd * es), vca(kca.size());
              for (auto& b : kca) b = (uint8_t)(rng() & 0x3b); for (auto& b : vca) b = (uint8_t)(rng() & 0x3b);
              auto kcb = kca, vcb = vca;
              auto x = vecn(d), xs = vecn(d);
              std::vector<float> oa(d), ob(d);
              int sa = A.attn_dec(am.data(), n_head, n_kv, hd, hd, 1e-5f, rp, x.data(), kca.data(), vca.data(), cdt, pos, oa.data(), act, nt);
              int sb = B.attn_dec(am.data(), n_head, n_kv, hd, hd, 1e-5f, rp, x.data(), kcb.data(), vcb.data(), cdt, pos, ob.data(), act, nt);
              check("attn_decode", sa == 0 && sa == sb && same(oa.data(), ob.data(), 4 * d) && kca == kcb && vca == vcb, tag);
              for (int pred = 0; pred < 2; ++pred)
                for (int withtau = 0; withtau < 2; ++withtau)
                  for (int ds = 0; ds < 2; ++ds)
                    for (int v : variants) {
                      if (ds && (pred || withtau)) continue;
                      std::vector<int64_t> fm(R_LEN);
                      record(pred, withtau, ds, v, fm.data());
                      std::vector<float> fa(d), fb(d);
                      const float* src = lay == 1 ? xs.data() : x.data();
                      int64_t ka = A.ffn_dec(fm.data(), 1e-5f, 0.0f, x.data(), src, fa.data(), act, nt);
                      int64_t kb = B.ffn_dec(fm.data(), 1e-5f, 0.0f, x.data(), src, fb.data(), act, nt);
                      check("ffn_decode", ka >= 0 && ka == kb && same(fa.data(), fb.data(), 4 * d), tag);
                    }
              // two layers
              // each library's records at its own stride (a later ABI may grow the record with
              // slots these layouts leave at zero; ABI 29 on, pp_layer_record_len is in bytes)
              std::vector<int64_t> rots = {P(rp), P(rp)};
              auto stacked = [&](const Lib& L) {
                const int64_t n = L.abi() >= 29 ? L.rec_len() / 8 : L.rec_len();
                std::vector<int64_t> one(R_LEN), v(2 * n);
                for (int l = 0; l < 2; ++l) {
                  record(l == 1, l == 1, false, variants.back(), one.data());
                  std::copy(one.begin(), one.begin() + std::min<int64_t>(n, R_LEN), v.begin() + l * n);
                }
                return v;
              };
              std::vector<int64_t> recsA = stacked(A), recsB = stacked(B);
              const int64_t lb = (pos + 1) * n_kv * hd * es;
              std::vector<uint8_t> KA(2 * lb), VA(2 * lb);
              for (auto& b : KA) b = (uint8_t)(rng() & 0x3b); for (auto& b : VA) b = (uint8_t)(rng() & 0x3b);
              auto KB = KA, VB = VA;
              auto xa = vecn(d), xb = xa;
              std::vector<int64_t> ca(2, -1), cb(2, -1);
              sa = A.decode_layers(2, recsA.data(), rots.data(), n_head, n_kv, hd, 1e-5f, KA.data(), VA.data(), lb, cdt, pos, xa.data(), ca.data(), act, nt);
              sb = B.decode_layers(2, recsB.data(), rots.data(), n_head, n_kv, hd, 1e-5f, KB.data(), VB.data(), lb, cdt, pos, xb.data(), cb.data(), act, nt);
              check("decode_layers", sa == 0 && sa == sb && same(xa.data(), xb.data(), 4 * d) && ca == cb && KA == KB && VA == VB, tag);
            }
    }
  }
  int bad = 0;
  for (auto& [k, v] : runs) { printf("%-14s %6d cases, %d mismatched\n", k.c_str(), v, fails[k]); bad += fails[k]; }
  printf(bad ? "FAIL\n" : "ALL IDENTICAL\n");
  return bad ? 1 : 0;
}
