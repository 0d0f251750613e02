#!/usr/bin/env bash
# Generates ./tokenizers/bpe, the encoder of the pure-Go stand-in for
# github.com/daulet/tokenizers, from kvbandit's own tokenizer package (the
# same files with the package renamed), so that no copy is committed.
# tools/build.sh runs it before it computes the build's cache key.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
src="$here/../../tokenizer"
dst="$here/tokenizers/bpe"
rm -rf "$dst"
mkdir -p "$dst"
for f in "$src"/*.go; do
  case "$f" in *_test.go) continue ;; esac
  sed 's/^package tokenizer$/package bpe/' "$f" > "$dst/$(basename "$f")"
done
