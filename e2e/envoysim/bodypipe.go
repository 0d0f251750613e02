package envoysim

import (
	"bytes"
	"io"
	"sync"
)

// ---- body pipe -----------------------------------------------------------

// bodyPipe is the upstream request body: the exchange loop writes to it
// without ever blocking, the HTTP transport reads it.
type bodyPipe struct {
	mu     sync.Mutex
	cond   *sync.Cond
	buf    bytes.Buffer
	done   bool   // no more writes
	err    error  // what Read returns once buf is drained (nil: io.EOF)
	atEOF  func() // run by the reader just before it returns io.EOF
	closed bool   // the reader is gone
}

func newBodyPipe() *bodyPipe {
	p := &bodyPipe{}
	p.cond = sync.NewCond(&p.mu)
	return p
}

func (p *bodyPipe) write(b []byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.done || p.closed {
		return
	}
	p.buf.Write(b)
	p.cond.Broadcast()
}

func (p *bodyPipe) closeWrite(err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.done {
		return
	}
	p.done = true
	p.err = err
	p.cond.Broadcast()
}

// closeWriteThen ends the body; f runs in the reader's goroutine right
// before its Read returns io.EOF.
func (p *bodyPipe) closeWriteThen(f func()) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.done {
		return
	}
	p.done = true
	p.atEOF = f
	p.cond.Broadcast()
}

// Read implements io.Reader.
func (p *bodyPipe) Read(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for p.buf.Len() == 0 && !p.done && !p.closed {
		p.cond.Wait()
	}
	switch {
	case p.closed:
		return 0, io.ErrClosedPipe
	case p.buf.Len() > 0:
		return p.buf.Read(b)
	case p.err != nil:
		return 0, p.err
	}
	if f := p.atEOF; f != nil {
		p.atEOF = nil
		f()
	}
	return 0, io.EOF
}

// Close implements io.Closer (the reader side).
func (p *bodyPipe) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	p.buf.Reset()
	p.cond.Broadcast()
	return nil
}
