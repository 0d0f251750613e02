//go:build unix

package tlsconfig

import (
	"os"
	"syscall"
)

// fileID returns the file's inode number, so that a file replaced by a
// rename is seen as changed even when its mtime and size are unchanged.
func fileID(fi os.FileInfo) uint64 {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return uint64(st.Ino)
	}
	return 0
}
