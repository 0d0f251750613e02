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
	mhi, mlo := bits.Mul64(lo, hi)
	acc := 16 + bits.ReverseBytes64(lo) + hi + (mhi ^ mlo)
	// XXH3's avalanche.
	acc ^= acc >> 37
	acc *= 0x165667919e3779f9
	return acc ^ acc>>32
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
	n := len(tokens) / blockSize
	if n == 0 {
		return dst
	}
	dst = slices.Grow(dst, n)
	var key uint64
	for i := range n {
		local := hashTokens(tokens[i*blockSize:(i+1)*blockSize:(i+1)*blockSize], seed)
		if i == 0 {
			key = local
		} else {
			key = ChainHash(key, local)
		}
		dst = append(dst, key)
	}
	return dst
}
