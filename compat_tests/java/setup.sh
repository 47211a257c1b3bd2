#!/usr/bin/env bash
# Fetch the pinned Apache Kafka jars (tools, Java client, broker, Streams) from Maven Central
# into compat_tests/.tools/java-lib, the classpath compat_tests/java_tools.py runs them from,
# and compile StreamsWordCount.java (test_streams.py) into compat_tests/.tools/java-classes.
#
# Idempotent: when the folders were built from these very files it does nothing, so a
# second run takes milliseconds. Without java or mvn it prints a SKIP and exits 0, except
# under CI=true, where the Java tests are required and a missing tool is an error.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
LIB="$ROOT/compat_tests/.tools/java-lib"
STAMP="$LIB/.pom-sha256"

skip() {
    if [ "${CI:-}" = "true" ]; then
        echo "java setup: $* (required under CI)" >&2
        exit 1
    fi
    echo "SKIP java tools setup: $*"
    exit 0
}

command -v java >/dev/null 2>&1 || skip "java not installed (a JDK 17+ is needed)"
command -v mvn >/dev/null 2>&1 || skip "mvn not installed (apt-get install maven)"

CLASSES="$ROOT/compat_tests/.tools/java-classes"
CLASSES_STAMP="$CLASSES/.sources-sha256"

compile_apps() {
    local want_src
    want_src="$(cat "$HERE/pom.xml" "$HERE/StreamsWordCount.java" | sha256sum | cut -d' ' -f1)"
    if [ "$(cat "$CLASSES_STAMP" 2>/dev/null || true)" = "$want_src" ]; then
        return 0
    fi
    command -v javac >/dev/null 2>&1 || skip "javac not installed (a JDK 17+ is needed)"
    rm -rf "$CLASSES"
    mkdir -p "$CLASSES"
    javac -nowarn -d "$CLASSES" -cp "$LIB/*" "$HERE/StreamsWordCount.java"
    echo "$want_src" > "$CLASSES_STAMP"
    echo "java setup: compiled StreamsWordCount"
}

want="$(sha256sum "$HERE/pom.xml" | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null || true)" = "$want" ]; then
    compile_apps
    exit 0
fi

echo "java setup: copying the Kafka jars pinned in compat_tests/java/pom.xml into ${LIB#"$ROOT"/}"
rm -rf "$LIB"
mkdir -p "$LIB"
# -B: no progress bars in CI logs; -q: errors only; sed drops the colour codes Debian's
# mvn prints even then. The jars land in ~/.m2 as well, so a rebuild of the folder after
# a pom change downloads only what is new. (pipefail: mvn's status is the pipeline's.)
if ! mvn -B -q -Dstyle.color=never -f "$HERE/pom.xml" dependency:copy-dependencies 2>&1 \
        | sed 's/\x1b\[[0-9;]*m//g'; then
    rm -rf "$LIB"
    echo "java setup: mvn dependency:copy-dependencies failed" >&2
    exit 1
fi
echo "$want" > "$STAMP"
echo "java setup: $(ls "$LIB"/*.jar | wc -l) jars"
compile_apps
