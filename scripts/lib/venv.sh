# Sourced by scripts/*: make sure .venv exists and holds this checkout, with the
# extras named in HK_EXTRAS (e.g. "test,compat"). Reinstalls only when pyproject.toml
# or the extras or the native core's sources (storage/native, built by setuptools-rust)
# change, so a second run starts at once.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
extras="${HK_EXTRAS:-}"
# HK_NO_INSTALL=1: use .venv as it is, never (re)install. compat_tests/test_docs.py runs the
# docs' commands in copies of the checkout that share this checkout's .venv: an install
# from a copy would point the .venv at it.
if [ -n "${HK_NO_INSTALL:-}" ]; then
    if [ ! -x "$VENV/bin/python" ]; then
        echo "hyperkafka: HK_NO_INSTALL is set but $VENV does not exist" >&2
        exit 2
    fi
    return 0
fi
if [ ! -x "$VENV/bin/python" ]; then
    echo "creating $VENV" >&2
    "$PY" -m venv "$VENV"
fi
# The native core (storage/native) builds with cargo; rustup installs it in ~/.cargo/bin,
# which a non-login shell may not have on PATH. Without cargo the install still succeeds
# (the extension is optional) and the pure-Python twin serves; under CI=true a unit test
# fails instead, so CI proves the native core was built.
if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
fi
if ! command -v cargo >/dev/null 2>&1; then
    echo "no cargo on PATH: storage._native (Rust) will not be built; install Rust with rustup" >&2
fi
stamp="$VENV/.hyperkafka-installed"
sources="$(cat "$ROOT/pyproject.toml" "$ROOT"/storage/native/Cargo.* "$ROOT"/storage/native/src/*.rs 2>/dev/null | sha256sum | cut -d' ' -f1)"
want="$sources [$extras]"
have="$(cat "$stamp" 2>/dev/null || true)"
# An install of these sources with extras also serves a script that needs none (scripts/serve
# after scripts/test): no reinstall.
if [ -z "$extras" ] && printf '%s\n' "$have" | grep -q "^$sources \["; then
    have="$have
$want"
fi
case "$have" in
    *"$want"*) ;;
    *)
        spec="$ROOT"
        [ -n "$extras" ] && spec="$ROOT[$extras]"
        echo "installing hyperkafka${extras:+ [$extras]} into $VENV" >&2
        "$VENV/bin/python" -m pip install -q --upgrade pip >&2
        "$VENV/bin/python" -m pip install -q -e "$spec" >&2
        printf '%s\n%s\n' "$have" "$want" > "$stamp"
        ;;
esac
