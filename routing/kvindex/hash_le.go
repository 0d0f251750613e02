//go:build 386 || amd64 || arm || arm64 || loong64 || mips64le || mipsle || ppc64le || riscv64 || wasm

package kvindex

import (
	"unsafe"

	"github.com/zeebo/xxh3"
)

// hashTokens hashes the raw memory of tokens, which on a little-endian host
// is exactly the little-endian encoding the scheme asks for.
func hashTokens(tokens []uint32, seed uint64) uint64 {
	if len(tokens) == 0 {
		return xxh3.HashSeed(nil, seed)
	}
	b := unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(tokens))), 4*len(tokens))
	return xxh3.HashSeed(b, seed)
}
