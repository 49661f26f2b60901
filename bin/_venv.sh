# Sourced by bin/moonplan and bin/test: make sure .venv exists and holds what
# pyproject.toml asks for (re-installed when pyproject.toml changes).
# Usage: moonplan_venv EXTRAS   (e.g. "" or "test" or "test,torchtitan")
#
# The stamp file has one line per install for the current pyproject.toml:
# "<hash of pyproject.toml> [extras]". A request is satisfied when every extra it names
# was installed before under the same hash (pip never uninstalls an extra's packages),
# so alternating bin/test and bin/moonplan installs nothing.
moonplan_venv() {
    local root extras stamp hash lines have missing e
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
    hash="$(sha256sum <"$root/pyproject.toml" | cut -c1-16)"
    # extras installed under this hash, one per line ("" when only the base install ran)
    lines="$(grep "^$hash " "$stamp" 2>/dev/null || true)"
    have="$(printf '%s\n' "$lines" | sed -e 's/^[^[]*\[//' -e 's/\]$//' | tr ',' '\n')"
    missing=""
    [ -n "$lines" ] || missing="base"
    for e in ${extras//,/ }; do
        printf '%s\n' "$have" | grep -qxF "$e" || missing="$missing $e"
    done
    if [ -n "$missing" ]; then
        echo "installing moonplan${extras:+[$extras]} into $VENV ..." >&2
        local spec="$root"
        [ -n "$extras" ] && spec="$root[$extras]"
        # torch is bounded in pyproject.toml so that pip picks a CPU build already on
        # disk where there is one instead of resolving a multi-GB CUDA build.
        "$VENV/bin/python" -m pip install -q -e "$spec" || return 1
        # keep every extras set installed under this hash; drop lines of older hashes
        { grep "^$hash " "$stamp" 2>/dev/null || true
          echo "$hash [$extras]"; } >"$stamp.new" && mv "$stamp.new" "$stamp"
    fi
}
