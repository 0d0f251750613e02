//go:build !(386 || amd64 || arm || arm64 || loong64 || mips64le || mipsle || ppc64le || riscv64 || wasm)

package kvindex

import (
	"encoding/binary"

	"github.com/zeebo/xxh3"
)

// hashTokens re-encodes tokens as little-endian bytes before hashing: this
// file is built on big-endian hosts only.
func hashTokens(tokens []uint32, seed uint64) uint64 {
	var stack [1024]byte
	var b []byte
	if 4*len(tokens) <= len(stack) {
		b = stack[:4*len(tokens)]
	} else {
		b = make([]byte, 4*len(tokens))
	}
	for i, t := range tokens {
		binary.LittleEndian.PutUint32(b[4*i:], t)
	}
	return xxh3.HashSeed(b, seed)
}
