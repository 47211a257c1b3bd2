#!/usr/bin/env bash
# Build the Go side of the compat lab into compat_tests/.tools:
#   hkgo      the franz-go + sarama driver the compat tests run (compat_tests/go/*.go)
#   kgo.test  franz-go's own pkg/kgo test binary, for the peer-suite run
#             (compat_tests/test_kgo_suite.py runs the allow-listed tests against hyperkafka)
#
# Modules come from the Go module proxy at the versions go.mod/go.sum pin (-mod=readonly:
# a build never edits them), into compat_tests/.tools/gomod; the build cache is
# compat_tests/.tools/gocache, so a second run takes seconds. Without a Go toolchain it
# prints a SKIP and exits 0, except under CI=true, where the Go clients are required.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
TOOLS="$ROOT/compat_tests/.tools"

skip() {
    if [ "${CI:-}" = "true" ]; then
        echo "go setup: $* (required under CI)" >&2
        exit 1
    fi
    echo "SKIP go clients setup: $*"
    exit 0
}

GO="$(command -v go || true)"
# The official Go tarball installs here; a root shell may not have it on PATH.
[ -z "$GO" ] && [ -x /usr/local/go/bin/go ] && GO=/usr/local/go/bin/go
[ -n "$GO" ] || skip "the Go toolchain is not installed (https://go.dev/dl, go 1.26)"

export GOMODCACHE="$TOOLS/gomod" GOCACHE="$TOOLS/gocache" GOFLAGS=-mod=readonly
export GOTOOLCHAIN=local CGO_ENABLED=0
mkdir -p "$TOOLS"
cd "$HERE"
started=$(date +%s)
"$GO" mod download
"$GO" build -o "$TOOLS/hkgo" .
# franz-go's module version is the one go.mod pins; its test binary runs from the package
# directory in the module cache (some of its tests read files beside them).
"$GO" test -c -o "$TOOLS/kgo.test" github.com/twmb/franz-go/pkg/kgo
"$GO" list -m -f '{{.Dir}}' github.com/twmb/franz-go > "$TOOLS/franz-go.dir"
echo "go setup: hkgo and kgo.test built with $("$GO" env GOVERSION) in $(( $(date +%s) - started )) s"
