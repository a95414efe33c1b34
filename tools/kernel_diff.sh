#!/usr/bin/env bash
# The native kernels of a git revision and of the working tree, compared bit for bit on random
# inputs for every export (tools/kernel_diff.cpp): a refactoring of powerpy/model/csrc/ must not
# change one output bit. Both libraries are built with the same FLAGS.
#
#   bash tools/kernel_diff.sh REV [FLAGS...]
#
# REV: the revision to compare with (e.g. the commit before a csrc change). FLAGS (default
# -O3 -march=native -flto, the production build; the tests also build -O2 -march=x86-64-v3 and
# -O2 -march=x86-64). CXX picks the compiler (default g++). Prints one line per export and
# "ALL IDENTICAL" or "FAIL"; exit status 0 only when identical.
set -eu
cd "$(dirname "${BASH_SOURCE[0]}")/.." # the repository root
[ $# -ge 1 ] || { sed -n '2,11p' "$0"; exit 2; }
REV=$1
shift
FLAGS=${*:--O3 -march=native -flto}
CXX=${CXX:-g++}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
git archive "$REV" powerpy/model/csrc | tar -x -C "$TMP"
build() { # OUT SOURCES...: every .cpp of a csrc/ (older revisions: the one sparse_ffn.cpp), in one
    # command; tiny matrices take every thread asked for (a build constant since ABI 20)
    out=$1
    shift
    # shellcheck disable=SC2086 # FLAGS are words
    $CXX $FLAGS -DPP_MIN_BYTES_PER_THREAD=1 -fopenmp -shared -fPIC -std=c++17 -o "$out" "$@"
}
build "$TMP/old.so" "$TMP"/powerpy/model/csrc/*.cpp &
p1=$!
build "$TMP/new.so" powerpy/model/csrc/*.cpp &
p2=$!
$CXX -O1 -std=c++17 -o "$TMP/kernel_diff" tools/kernel_diff.cpp -ldl
wait $p1
wait $p2
echo "$REV vs the working tree, $FLAGS:"
"$TMP/kernel_diff" "$TMP/old.so" "$TMP/new.so"
