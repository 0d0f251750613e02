package tokenizer

import (
	"path/filepath"
	"testing"
)

// BenchmarkLoad measures Load of each fixture tokenizer.
func BenchmarkLoad(b *testing.B) {
	for _, name := range oracleModels {
		p := filepath.Join(fixturesDir(b), name)
		b.Run(name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := Load(p); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
