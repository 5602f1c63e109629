#!/usr/bin/env bash
# corpora.sh: the real-text corpora of the convergence check (scripts/convergence.sh), made from
# Debian packages, byte-level, about 2.5 MB each:
#   fortunes.txt  every fortune file of the package `fortunes` (English quotations and jokes)
#   vimdoc.txt    the first 2,600,000 bytes of vim's manual (package `vim-runtime`, doc/*.txt)
#
#   scripts/corpora.sh [DIR]      (default .corpora; prints DIR)
#
# Files already in DIR are kept, so a machine without the packages (the GPU machine has no
# package registry) uses a copy carried there. Missing packages are installed with apt-get when
# it is available.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DIR="${1:-.corpora}"
mkdir -p "$DIR"
CORPUS_BYTES=2600000

need=()
[ -s "$DIR/fortunes.txt" ] || [ -d /usr/share/games/fortunes ] || need+=(fortunes)
[ -s "$DIR/vimdoc.txt" ] || compgen -G "/usr/share/vim/vim*/doc/*.txt" >/dev/null || need+=(vim-runtime)
if ((${#need[@]})); then
  command -v apt-get >/dev/null || {
    echo "corpora.sh: no $DIR/fortunes.txt or vimdoc.txt and no apt-get to install ${need[*]}" >&2
    exit 2
  }
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${need[@]}" >/dev/null
fi

if [ ! -s "$DIR/fortunes.txt" ]; then
  # The text files only: each has a .dat index beside it; .u8 files are links to them.
  find /usr/share/games/fortunes -maxdepth 1 -type f -name '*.dat' | sort |
    while read -r index; do cat "${index%.dat}"; done >"$DIR/fortunes.txt"
fi
if [ ! -s "$DIR/vimdoc.txt" ]; then
  # cat stops on SIGPIPE once head has its bytes: not a failure.
  # shellcheck disable=SC2046
  (cat $(ls /usr/share/vim/vim*/doc/*.txt | sort) || true) | head -c "$CORPUS_BYTES" \
    >"$DIR/vimdoc.txt"
fi
for f in fortunes vimdoc; do
  [ -s "$DIR/$f.txt" ] || { echo "corpora.sh: could not make $DIR/$f.txt" >&2; exit 2; }
done
echo "$DIR"
