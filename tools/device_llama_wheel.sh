#!/usr/bin/env bash
# Build llama.cpp's CUDA build (llama-cpp-python, the version the CPU oracle pins) as a wheel for
# the lent GPU machine, the speed anchor of tools/device_llama.py.
#
#   bash tools/device_llama_wheel.sh [DIR]     # default DIR: .device-wheels (git-ignored)
#
# The development machine has nvcc 13 but no cuBLAS: the registry's nvidia-cublas wheel brings
# its headers and libraries, linked here and found on the device in torch's own CUDA 13 wheels
# (tools/device_llama.py puts their folders on LD_LIBRARY_PATH). Built for sm_90 only (H100 and
# H200); without CUDA VMM (its pool needs libcuda at link time, which this machine lacks; the
# legacy pool serves the same buffers); without the FlashAttention kernels (decode at a short
# context does not need them, and they double the build and the size); with the CPU backend at
# AVX-512, not -march=native, since the device's CPU is not this one (device_llama.py refuses
# to run it on a CPU without AVX-512). Two cores take about 25 minutes; a wheel already in DIR is
# kept (delete it to rebuild). The libraries are stripped; the script says what the wheels weigh,
# since everything carried to the device must fit 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.device-wheels}
ORACLE="llama-cpp-python==0.3.36"
WORK=${WORK:-/tmp/powerpy-llama-cuda}
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
mkdir -p "$WORK" "$DIR"
if ls "$DIR"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    echo "kept: $(ls "$DIR"/llama_cpp_python-*.whl)"
    exit 0
fi

if [ ! -d "$WORK/cublas/nvidia/cu13" ]; then
    python -m pip download --quiet --no-deps "nvidia-cublas>=13,<14" -d "$WORK/dl"
    (cd "$WORK" && mkdir -p cublas && cd cublas && unzip -q -o ../dl/nvidia_cublas-*.whl)
fi
CUBLAS="$WORK/cublas/nvidia/cu13"
for lib in cublas cublasLt; do ln -sf "lib$lib.so.13" "$CUBLAS/lib/lib$lib.so"; done

if [ ! -d "$WORK/src" ]; then
    python -m pip download --quiet --no-deps --no-binary :all: "$ORACLE" -d "$WORK/dl"
    mkdir -p "$WORK/src" && tar xzf "$WORK"/dl/llama_cpp_python-*.tar.gz -C "$WORK/src" --strip-components 1
fi

ARGS=(
    -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90-real -DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF -DGGML_CUDA_NO_VMM=ON
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAVA_BUILD=OFF
    "-DCUDA_cublas_LIBRARY=$CUBLAS/lib/libcublas.so" "-DCUDA_cublasLt_LIBRARY=$CUBLAS/lib/libcublasLt.so"
    "-DCMAKE_CUDA_FLAGS=-I$CUBLAS/include" "-DCMAKE_CXX_FLAGS=-I$CUBLAS/include"
)
if ! ls "$WORK"/wheel/llama_cpp_python-*.whl >/dev/null 2>&1; then  # (a build is kept)
    (cd "$WORK/src" && CUDACXX="$NVCC" CMAKE_ARGS="${ARGS[*]}" \
        CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) python -m pip wheel . --no-deps -w "$WORK/wheel")
fi

# strip the libraries inside the wheel, then put it beside the other device wheels
wheel=$(ls "$WORK"/wheel/llama_cpp_python-*.whl)
rm -rf "$WORK/unpacked" && mkdir -p "$WORK/unpacked" && (cd "$WORK/unpacked" && unzip -q "$wheel")
find "$WORK/unpacked" -name '*.so*' -exec strip --strip-unneeded {} +
# the wheel holds each library three times (lib.so, its SONAME lib.so.0 and lib.so.0.x.y, copies
# where the build had links): keep the names llama_cpp opens (libllama.so, libggml.so; libmtmd.so
# where built) and the SONAMEs the libraries need
# (and not again at the wheel's root, with the headers: llama_cpp reads its own folder)
rm -rf "$WORK"/unpacked/lib "$WORK"/unpacked/include "$WORK"/unpacked/bin
(
    cd "$WORK"/unpacked/llama_cpp/lib
    rm -f ./*.so.*.* libllama.so.0
    for f in lib*.so; do
        case $f in libllama.so | libggml.so | libmtmd.so) ;; *) [[ -e $f.0 ]] && rm -f "$f" ;; esac
    done
    ls -l
)
python - "$WORK/unpacked" "$wheel" <<'EOF'
import base64, hashlib, pathlib, sys, zipfile
root, wheel = pathlib.Path(sys.argv[1]), sys.argv[2]
files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != "RECORD")
record = next(root.glob("*.dist-info")) / "RECORD"
lines = []
for p in files:
    digest = base64.urlsafe_b64encode(hashlib.sha256(p.read_bytes()).digest()).rstrip(b"=")
    lines.append(f"{p.relative_to(root)},sha256={digest.decode()},{p.stat().st_size}")
lines.append(f"{record.relative_to(root)},,")
record.write_text("\n".join(lines) + "\n")
with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
    for p in [*files, record]:
        z.write(p, p.relative_to(root))
EOF
cp "$wheel" "$DIR/"
ls -l "$DIR"/llama_cpp_python-*.whl
total=$(find "$DIR" -type f -name '*.whl' -printf '%s\n' | awk '{s += $1} END {print s + 0}')
echo "all wheels in $DIR: $(awk -v b="$total" 'BEGIN {printf "%.1f", b / 1048576}') MiB (64 MiB may be carried in all)"
