// Package tokenizer encodes text into the token ids a Hugging Face tokenizer
// (tokenizer.json) produces, in pure Go, so that KV-cache block keys computed by
// the router equal the ones the vLLM worker computes.
//
// # Overview
//
// [Load] reads a tokenizer.json (or a model directory holding tokenizer.json and
// tokenizer_config.json) and returns a [*BPE]. Two model families are supported:
//
//   - byte-level BPE (GPT-2, Llama 3/3.1, Qwen2/3, DeepSeek-V3 style): an optional
//     NFC normalizer, a pre-tokenizer made of Split (regex, Isolated) and ByteLevel
//     steps, including a Sequence of several Splits;
//   - SentencePiece-style BPE (Mistral 7B, Llama 2): a Prepend("▁") + Replace(" ", "▁")
//     normalizer, no pre-tokenizer, byte_fallback to <0xXX> tokens and fuse_unk.
//
// Anything else is rejected with an error wrapping [ErrUnsupported]; a file that is
// not a valid tokenizer.json yields an error wrapping [ErrCorrupt].
//
// Encode has the semantics of HF `encode(text, add_special_tokens=False)`: no BOS
// or EOS is added, but added and special tokens that occur verbatim in the text
// are matched (leftmost-longest, honouring single_word, lstrip, rstrip and
// normalized), as transformers and vLLM do. Near look-alikes such as
// "<|im_start |>" stay text. Added-token ids are assigned as HF does (an
// existing vocabulary id wins over the id written in the file).
//
// The Split regexes of GPT-2, Llama 3/3.1, Qwen2/3 and the three of
// DeepSeek-V3 are recognised by their exact pattern strings and run by
// hand-written pre-tokenizers; any other pattern runs through
// github.com/dlclark/regexp2 (about 4 MB/s for DeepSeek-V3's, against 21 MB/s
// hand-written). TestSplitterMatchesRegexp2 checks that both agree split for
// split on the oracle corpus.
//
// BPE merges follow HF's order exactly (lowest rank, then leftmost): words of up
// to 48 symbols use a rank array, longer ones a binary heap, so a 10 MB word
// costs O(n log n) (about 1 s per MB for a run of one character). Words of up to
// 64 bytes are cached in a fixed-size, lock-free table. [BPE.Decode] inverts
// Encode up to normalization.
//
// Tests compare ids with HF tokenizers@0.23.2 (node) on testdata/corpus.json
// plus generated 20–50 KB texts, for Qwen3, Llama 3.1 and Mistral 7B; the
// fixtures come from testdata/fixtures.sh.
//
// Invalid UTF-8: JavaScript and Python strings cannot hold invalid UTF-8, so the
// HF oracle never sees it. Encode replaces every byte that is not part of a valid
// UTF-8 sequence with U+FFFD (Go's decoding rule, one U+FFFD per bad byte) before
// tokenizing. Lone surrogates sent through JSON (\ud800) are already decoded to
// U+FFFD by encoding/json, which is what the node binding does too.
//
// # Concurrency
//
// A *BPE is immutable after Load, except for a bounded, lock-free per-word cache;
// all methods may be called from many goroutines at once.
//
// # Prefix caching
//
// [BPE.SafeSplit] returns a byte offset at which a text can be cut without
// changing its tokenization; [PrefixCache] builds on it to encode only the new
// suffix of a growing conversation.
package bpe
