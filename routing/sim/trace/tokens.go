package trace

// Salts keep the token streams of different origins apart.
const (
	saltBlock  uint64 = 0x6b76_6261_6e64_6974 // Mooncake hash-id blocks
	saltUnique uint64 = 0x756e_6971_7565_746b // per-request tokens
	saltSystem uint64 = 0x7379_7374_656d_7072 // agentic system prompts
	saltTurn   uint64 = 0x7475_726e_7475_726e // agentic turns
)

// splitmix64 is the SplitMix64 finalizer.
func splitmix64(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

// appendTokens appends n tokens of the stream (salt, stream), starting at
// position from.
func appendTokens(dst []uint32, salt, stream uint64, from, n int) []uint32 {
	base := splitmix64(salt ^ stream)
	for i := range n {
		dst = append(dst, uint32(splitmix64(base+uint64(from+i))>>33))
	}
	return dst
}
