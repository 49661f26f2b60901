# Sourced by bin/moonplan and bin/test: make sure .venv exists and holds what
# pyproject.toml asks for (re-installed when pyproject.toml changes).
# Usage: moonplan_venv EXTRAS   (e.g. "" or "test")
moonplan_venv() {
    local root extras stamp want
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    extras="$1"
    VENV="${MOONPLAN_VENV:-$root/.venv}"
    if [ ! -x "$VENV/bin/python" ]; then
        local py="${PYTHON:-python3}"
        "$py" -c 'import sys; assert sys.version_info >= (3, 10), sys.version' \
            || { echo "moonplan needs Python >= 3.10 (set PYTHON=...)" >&2; return 1; }
        echo "creating $VENV ..." >&2
        "$py" -m venv "$VENV" || return 1
    fi
    stamp="$VENV/.moonplan-installed"
    want="$(cat "$root/pyproject.toml" | sha256sum | cut -c1-16) [$extras]"
    if [ ! -f "$stamp" ] || ! grep -qxF "$want" "$stamp"; then
        echo "installing moonplan${extras:+[$extras]} into $VENV ..." >&2
        local spec="$root"
        [ -n "$extras" ] && spec="$root[$extras]"
        # torch is bounded in pyproject.toml so that pip picks a CPU build already on
        # disk where there is one instead of resolving a multi-GB CUDA build.
        "$VENV/bin/python" -m pip install -q -e "$spec" || return 1
        # Remember every extras set installed so far, so bin/test does not undo bin/moonplan.
        { grep -v "^$(cat "$root/pyproject.toml" | sha256sum | cut -c1-16) " "$stamp" 2>/dev/null || true
          echo "$want"; } >"$stamp.new" && mv "$stamp.new" "$stamp"
    fi
}
