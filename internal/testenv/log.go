package testenv

import (
	"bytes"
	"sync"
)

// maxLog bounds a Log; what comes after is dropped.
const maxLog = 1 << 20

// Log collects a process's output (pass it to [Start]) in memory, up to
// 1 MiB. It is safe for concurrent use; the zero value is empty.
type Log struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

// Write appends p, or drops it once the log holds 1 MiB.
func (l *Log) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.buf.Len() > maxLog {
		return len(p), nil
	}
	return l.buf.Write(p)
}

// String returns what the log holds.
func (l *Log) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}
