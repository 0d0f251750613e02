package kvindex

import (
	"math/bits"
	"slices"

	"github.com/zeebo/xxh3"
)

// BaseSeed is the XXH3 seed of an unsalted block hash and of every chain
// step (Dynamo's XXH3_SEED).
const BaseSeed uint64 = 1337

// Seed returns the XXH3 seed for blocks of a request: [BaseSeed] plus
// XXH3-64(lora, seed 0) when lora is not empty, plus XXH3-64(namespace,
// seed 1) when namespace is not empty (wrapping additions). Empty strings
// mean absent, so lora "" shares cache with the base model.
func Seed(lora, namespace string) uint64 {
	s := BaseSeed
	if lora != "" {
		s += xxh3.HashStringSeed(lora, 0)
	}
	if namespace != "" {
		s += xxh3.HashStringSeed(namespace, 1)
	}
	return s
}

// LocalHash returns the content hash of one block: XXH3-64 of its tokens,
// each as a 4-byte little-endian integer, with the given seed (see [Seed]).
// It does not depend on the blocks before it.
func LocalHash(block []uint32, seed uint64) uint64 {
	return hashTokens(block, seed)
}

// ChainHash returns the key of a block given its parent's key and its own
// [LocalHash]: XXH3-64(le64(parent) || le64(local), [BaseSeed]). The chain
// step is never salted; the salt is already in local.
//
// It is XXH3-64's 9–16-byte case written out for these 16 bytes and the
// constant seed (so the hot path pays no call into the general hash);
// TestChainHashIsXXH3 checks it against xxh3.HashSeed of the bytes.
func ChainHash(parent, local uint64) uint64 {
	lo := parent ^ chainFlip1
	hi := local ^ chainFlip2
	return avalanche(16 + bits.ReverseBytes64(lo) + hi + mulFold(lo, hi))
}

// chainFlip1 and chainFlip2 are XXH3's bitflips for a 9–16-byte input
// with seed BaseSeed: (secret[24:32] ^ secret[32:40]) + seed and
// (secret[40:48] ^ secret[48:56]) - seed, secret being XXH3's default.
const (
	chainFlip1 = (0x1f67b3b7a4a44072 ^ 0x78e5c0cc4ee679cb) + BaseSeed
	chainFlip2 = (0x2172ffcc7dd05a82 ^ 0x8e2443f7744608b8) - BaseSeed
)

// AppendBlockKeys appends to dst the chained keys of the complete blocks of
// tokens and returns the extended slice: key[0] = LocalHash(block 0) and
// key[i] = ChainHash(key[i-1], LocalHash(block i)). A trailing partial block
// is ignored, and blockSize <= 0 yields no keys. It allocates only when dst
// lacks capacity.
func AppendBlockKeys(dst []uint64, tokens []uint32, blockSize int, seed uint64) []uint64 {
	if blockSize <= 0 {
		return dst
	}
	return appendChain(dst, tokens, blockSize, seed, 0, 0)
}

// ExtendBlockKeys returns the keys of all complete blocks of tokens, given
// keys, the keys of its first len(keys) blocks as [AppendBlockKeys] computes
// them (for instance of an earlier turn of the same conversation): only the
// blocks after them are hashed, the chain continuing from the last. The
// result is AppendBlockKeys(nil, tokens, blockSize, seed) when keys is
// right; keys longer than tokens' blocks are cut to them. It appends to keys
// (allocating only when it lacks capacity).
func ExtendBlockKeys(keys []uint64, tokens []uint32, blockSize int, seed uint64) []uint64 {
	if blockSize <= 0 {
		return keys[:0]
	}
	n, from := len(tokens)/blockSize, len(keys)
	if from >= n {
		return keys[:n]
	}
	var parent uint64
	if from > 0 {
		parent = keys[from-1]
	}
	return appendChain(keys, tokens, blockSize, seed, from, parent)
}

// appendChain appends the keys of tokens' complete blocks from block from
// on, parent being the key of block from-1 (unused when from is 0).
func appendChain(dst []uint64, tokens []uint32, blockSize int, seed uint64, from int, parent uint64) []uint64 {
	n := len(tokens) / blockSize
	if n <= from {
		return dst
	}
	dst = slices.Grow(dst, n-from)
	var sec16 *secret16
	if blockSize == 16 {
		sec16 = newSecret16(seed)
	}
	key := parent
	for i := from; i < n; i++ {
		block := tokens[i*blockSize : (i+1)*blockSize : (i+1)*blockSize]
		var local uint64
		if sec16 != nil {
			local = sec16.hash((*[16]uint32)(block))
		} else {
			local = hashTokens(block, seed)
		}
		if i == 0 {
			key = local
		} else {
			key = ChainHash(key, local)
		}
		dst = append(dst, key)
	}
	return dst
}

// secret16 holds XXH3's default secret words for a 33–64-byte input,
// seeded, so that a block of 16 tokens (64 bytes, the default block size)
// is hashed by XXH3-64's case for that length written out, the seeding
// done once per prompt. TestAppendKeys16IsXXH3 checks it against xxh3.
type secret16 [8]uint64

func newSecret16(seed uint64) *secret16 {
	return &secret16{
		0xbe4ba423396cfeb8 + seed, 0x1cad21f72c81017c - seed,
		0xdb979083e96dd4de + seed, 0x1f67b3b7a4a44072 - seed,
		0x78e5c0cc4ee679cb + seed, 0x2172ffcc7dd05a82 - seed,
		0x8e2443f7744608b8 + seed, 0x4c263a81e69035e0 - seed,
	}
}

// hash is XXH3-64 of the block's little-endian bytes.
func (k *secret16) hash(t *[16]uint32) uint64 {
	// The bytes as eight 64-bit little-endian words.
	w0, w1 := uint64(t[0])|uint64(t[1])<<32, uint64(t[2])|uint64(t[3])<<32
	w2, w3 := uint64(t[4])|uint64(t[5])<<32, uint64(t[6])|uint64(t[7])<<32
	w4, w5 := uint64(t[8])|uint64(t[9])<<32, uint64(t[10])|uint64(t[11])<<32
	w6, w7 := uint64(t[12])|uint64(t[13])<<32, uint64(t[14])|uint64(t[15])<<32
	acc := uint64(0x8dde6c617af2a1c0) // 64 × PRIME64_1, wrapped
	acc += mulFold(w2^k[4], w3^k[5]) + mulFold(w4^k[6], w5^k[7])
	acc += mulFold(w0^k[0], w1^k[1]) + mulFold(w6^k[2], w7^k[3])
	return avalanche(acc)
}

// avalanche is XXH3's final mix.
func avalanche(x uint64) uint64 {
	x ^= x >> 37
	x *= 0x165667919e3779f9
	return x ^ x>>32
}

func mulFold(x, y uint64) uint64 {
	hi, lo := bits.Mul64(x, y)
	return hi ^ lo
}
