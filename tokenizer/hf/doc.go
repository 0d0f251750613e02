// Package hf is the optional tokenizer backend built on Hugging Face's own
// Rust tokenizers library through cgo (github.com/daulet/tokenizers). It is
// compiled only with the build tag hftokenizers, for operators who have the
// native library (libtokenizers.a) at link time:
//
//	go build -tags hftokenizers ./cmd/kvbandit
//
// Without the tag this package is empty and kvbandit uses its pure-Go
// tokenizer (package tokenizer), which is checked against the same library.
// The library cannot be built on machines without the Rust crates registry,
// so CI only vets this package (go vet -tags hftokenizers ./tokenizer/...).
package hf
