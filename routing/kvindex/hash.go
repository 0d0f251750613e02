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
	acc := 16 + bits.ReverseBytes64(lo) + hi + mulFold(lo, hi)
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
	if blockSize == 16 {
		return appendKeys16(dst, tokens[:16*n], seed)
	}
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

// appendKeys16 is AppendBlockKeys for blocks of 16 tokens (64 bytes, the
// default block size), with XXH3-64's 33–64-byte case written out and its
// seeded secret words computed once for all blocks. tokens holds whole
// blocks; dst has room for them. TestAppendKeys16IsXXH3 checks it against
// the general path.
func appendKeys16(dst []uint64, tokens []uint32, seed uint64) []uint64 {
	k0, k1 := 0xbe4ba423396cfeb8+seed, 0x1cad21f72c81017c-seed
	k2, k3 := 0xdb979083e96dd4de+seed, 0x1f67b3b7a4a44072-seed
	k4, k5 := 0x78e5c0cc4ee679cb+seed, 0x2172ffcc7dd05a82-seed
	k6, k7 := 0x8e2443f7744608b8+seed, 0x4c263a81e69035e0-seed
	var key uint64
	for i := 0; i+16 <= len(tokens); i += 16 {
		t := (*[16]uint32)(tokens[i : i+16])
		// The block's little-endian bytes as eight 64-bit words.
		w0, w1 := uint64(t[0])|uint64(t[1])<<32, uint64(t[2])|uint64(t[3])<<32
		w2, w3 := uint64(t[4])|uint64(t[5])<<32, uint64(t[6])|uint64(t[7])<<32
		w4, w5 := uint64(t[8])|uint64(t[9])<<32, uint64(t[10])|uint64(t[11])<<32
		w6, w7 := uint64(t[12])|uint64(t[13])<<32, uint64(t[14])|uint64(t[15])<<32
		acc := uint64(0x8dde6c617af2a1c0) // 64 × PRIME64_1, wrapped
		acc += mulFold(w2^k4, w3^k5) + mulFold(w4^k6, w5^k7)
		acc += mulFold(w0^k0, w1^k1) + mulFold(w6^k2, w7^k3)
		acc ^= acc >> 37
		acc *= 0x165667919e3779f9
		local := acc ^ acc>>32
		if i == 0 {
			key = local
		} else {
			key = ChainHash(key, local)
		}
		dst = append(dst, key)
	}
	return dst
}

func mulFold(x, y uint64) uint64 {
	hi, lo := bits.Mul64(x, y)
	return hi ^ lo
}
