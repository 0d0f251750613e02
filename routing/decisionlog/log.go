package decisionlog

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/prefixstate"
)

// Defaults applied to zero [Options] fields.
const (
	DefaultBuffer        = 4096
	DefaultFlushInterval = time.Second
)

// Options tune a [Log]. The zero value is usable.
type Options struct {
	// Buffer is the number of records that may wait for the writer; when
	// it is full, Record drops. 0 means DefaultBuffer.
	Buffer int
	// FlushInterval is how often buffered output is flushed to the file.
	// 0 means DefaultFlushInterval.
	FlushInterval time.Duration
	// MaxBytes, when > 0, bounds the file [Open] writes: when the next
	// record would take it past MaxBytes, the file is renamed to
	// path + ".1" and a new one started, so at most about 2 × MaxBytes are
	// kept. [New] rejects it (there is no path to rotate).
	MaxBytes int64
	// Clock drives the periodic flush and stamps records without a Time;
	// nil means the real clock.
	Clock clock.Clock
	// Logger reports the first write error; nil means slog.Default().
	Logger *slog.Logger
}

func (o Options) validate() error {
	var errs []error
	if o.Buffer < 0 {
		errs = append(errs, fmt.Errorf("Buffer: must be >= 0 (0 means %d), got %d", DefaultBuffer, o.Buffer))
	}
	if o.FlushInterval < 0 {
		errs = append(errs, fmt.Errorf("FlushInterval: must be >= 0 (0 means %v), got %v", DefaultFlushInterval, o.FlushInterval))
	}
	if o.MaxBytes < 0 {
		errs = append(errs, fmt.Errorf("MaxBytes: must be >= 0 (0 means unbounded), got %d", o.MaxBytes))
	}
	return errors.Join(errs...)
}

// Stats are a Log's counters.
type Stats struct {
	// Written counts records handed to the buffered writer (a later
	// failed flush loses them and counts a write error).
	Written uint64
	// Dropped counts records not accepted: the buffer was full or the log
	// was closed.
	Dropped uint64
	// WriteErrors counts failed writes, flushes and rotations.
	WriteErrors uint64
	// Rotations counts file rotations.
	Rotations uint64
}

// Log is an asynchronous decision log. Create it with [Open] or [New];
// Record and the counters are safe for concurrent use.
type Log struct {
	format   Format
	interval time.Duration
	clk      clock.Clock
	logger   *slog.Logger

	ch      chan Record
	flushC  chan struct{} // the flush timer's kick, capacity 1
	quit    chan struct{}
	stopped chan struct{}
	closed  atomic.Bool
	once    sync.Once
	err     error // the first flush or close error; read after stopped

	written, dropped, writeErrs, rotations atomic.Uint64

	// Owned by the writer goroutine.
	out      io.Writer // what bw writes to: the caller's writer or file
	bw       *bufio.Writer
	scratch  []byte
	timer    clock.Timer
	errShown bool
	file     *rotatingFile // nil for New
}

// Open starts a log that appends to the file at path, creating it (mode
// 0644) if needed. The CSV header is written when the file is empty. With
// opts.MaxBytes the file is rotated to path + ".1".
func Open(path string, format Format, opts Options) (*Log, error) {
	if err := checkFormat(format); err != nil {
		return nil, err
	}
	if err := opts.validate(); err != nil {
		return nil, fmt.Errorf("decisionlog: %w", err)
	}
	rf := &rotatingFile{path: path, max: opts.MaxBytes}
	if err := rf.open(); err != nil {
		return nil, fmt.Errorf("decisionlog: %w", err)
	}
	return start(rf, rf, format, opts), nil
}

// New starts a log that writes to w. It never closes w. opts.MaxBytes must
// be 0.
func New(w io.Writer, format Format, opts Options) (*Log, error) {
	if err := checkFormat(format); err != nil {
		return nil, err
	}
	if err := opts.validate(); err != nil {
		return nil, fmt.Errorf("decisionlog: %w", err)
	}
	if opts.MaxBytes != 0 {
		return nil, errors.New("decisionlog: MaxBytes: rotation needs a file; use Open")
	}
	return start(w, nil, format, opts), nil
}

func checkFormat(f Format) error {
	if f != CSV && f != JSONL {
		return fmt.Errorf("decisionlog: unknown format %v", f)
	}
	return nil
}

func start(w io.Writer, rf *rotatingFile, format Format, opts Options) *Log {
	if opts.Buffer == 0 {
		opts.Buffer = DefaultBuffer
	}
	if opts.FlushInterval == 0 {
		opts.FlushInterval = DefaultFlushInterval
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	l := &Log{
		format:   format,
		interval: opts.FlushInterval,
		clk:      clock.Or(opts.Clock),
		logger:   opts.Logger,
		ch:       make(chan Record, opts.Buffer),
		flushC:   make(chan struct{}, 1),
		quit:     make(chan struct{}),
		stopped:  make(chan struct{}),
		out:      w,
		bw:       bufio.NewWriterSize(w, 64<<10),
		scratch:  make([]byte, 0, 1024),
		file:     rf,
	}
	if format == CSV && (rf == nil || rf.size == 0) {
		l.writeHeader()
	}
	l.timer = l.clk.AfterFunc(l.interval, l.kick)
	go l.run()
	return l
}

// Record queues r for writing. It never blocks: when the buffer is full or
// the log is closed, r is dropped and counted. It takes ownership of
// r.Scores. The client-supplied Tenant and PrefixID are bounded first with
// [prefixstate.BoundID] (a long id is logged as its hash, as the prefix
// state stores it), so a queued record holds a bounded number of bytes.
func (l *Log) Record(r Record) {
	if l.closed.Load() {
		l.dropped.Add(1)
		return
	}
	r.Tenant, r.PrefixID = prefixstate.BoundID(r.Tenant), prefixstate.BoundID(r.PrefixID)
	select {
	case l.ch <- r:
	default:
		l.dropped.Add(1)
	}
}

// Dropped returns the number of records dropped so far.
func (l *Log) Dropped() uint64 { return l.dropped.Load() }

// Stats returns the counters.
func (l *Log) Stats() Stats {
	return Stats{
		Written:     l.written.Load(),
		Dropped:     l.dropped.Load(),
		WriteErrors: l.writeErrs.Load(),
		Rotations:   l.rotations.Load(),
	}
}

// Close stops accepting records, writes every record already accepted,
// flushes, closes the file Open opened, and waits for the writer goroutine
// to exit (so a Write that never returns blocks Close too). It returns the
// final flush or close error, if any; earlier write errors are in [Stats].
// Further calls return the same result.
func (l *Log) Close() error {
	l.once.Do(func() {
		l.closed.Store(true)
		close(l.quit)
		<-l.stopped
		// A Record racing with Close may have slipped into the channel
		// after the writer's last drain: count it as dropped.
		for {
			select {
			case <-l.ch:
				l.dropped.Add(1)
				continue
			default:
			}
			break
		}
	})
	return l.err
}

// kick is the flush timer's callback; it never blocks.
func (l *Log) kick() {
	select {
	case l.flushC <- struct{}{}:
	default:
	}
}

func (l *Log) run() {
	defer close(l.stopped)
	for {
		select {
		case r := <-l.ch:
			l.write(&r)
		case <-l.flushC:
			l.flush()
			l.timer = l.clk.AfterFunc(l.interval, l.kick)
		case <-l.quit:
			l.timer.Stop()
			for drained := false; !drained; {
				select {
				case r := <-l.ch:
					l.write(&r)
				default:
					drained = true
				}
			}
			err := l.flush()
			if l.file != nil {
				err = errors.Join(err, l.file.close())
			}
			l.err = err
			return
		}
	}
}

func (l *Log) write(r *Record) {
	if r.Time.IsZero() {
		r.Time = l.clk.Now()
	}
	b := l.scratch[:0]
	if l.format == CSV {
		b = appendCSV(b, r)
	} else {
		b = appendJSON(b, r)
	}
	l.scratch = b
	if l.file != nil && l.file.full(len(b)) {
		l.rotate()
	}
	n, err := l.bw.Write(b)
	if l.file != nil {
		l.file.size += int64(n)
	}
	if err != nil {
		l.fail("write", err)
		return
	}
	l.written.Add(1)
}

func (l *Log) writeHeader() {
	h := csvHeader()
	n, err := l.bw.Write(h)
	if l.file != nil {
		l.file.size += int64(n)
		l.file.header = int64(len(h))
	}
	if err != nil {
		l.fail("write header", err)
	}
}

func (l *Log) flush() error {
	if err := l.bw.Flush(); err != nil {
		l.fail("flush", err)
		return err
	}
	return nil
}

func (l *Log) rotate() {
	if err := l.flush(); err != nil {
		return
	}
	if err := l.file.rotate(); err != nil {
		l.fail("rotate", err)
		return
	}
	l.rotations.Add(1)
	l.bw.Reset(l.out)
	if l.format == CSV {
		l.writeHeader()
	}
}

// fail counts a write error and logs the first one. A failed bufio.Writer
// stays failed, so it is reset: the buffered bytes are lost, later records
// are tried again.
func (l *Log) fail(op string, err error) {
	l.writeErrs.Add(1)
	if !l.errShown {
		l.errShown = true
		l.logger.Warn("decision log write failed; later failures are only counted",
			"op", op, "error", err)
	}
	l.bw.Reset(l.out)
}

// rotatingFile is the file behind Open, with its size for rotation.
type rotatingFile struct {
	path   string
	max    int64
	f      *os.File
	size   int64
	header int64 // bytes of the CSV header in the current file
}

func (r *rotatingFile) open() error {
	f, err := os.OpenFile(r.path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return err
	}
	r.f, r.size, r.header = f, st.Size(), 0
	return nil
}

// full reports whether a record of n bytes should go to a new file: it
// would pass the limit and the current file holds more than a header.
func (r *rotatingFile) full(n int) bool {
	return r.max > 0 && r.size+int64(n) > r.max && r.size > r.header
}

func (r *rotatingFile) rotate() error {
	if r.f != nil {
		if err := r.f.Close(); err != nil {
			r.f = nil
			return err
		}
		r.f = nil
	}
	if err := os.Rename(r.path, r.path+".1"); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return r.open()
}

func (r *rotatingFile) Write(p []byte) (int, error) {
	if r.f == nil {
		// A failed rotation: try to reopen on every write.
		if err := r.open(); err != nil {
			return 0, err
		}
	}
	return r.f.Write(p)
}

func (r *rotatingFile) close() error {
	if r.f == nil {
		return nil
	}
	err := r.f.Close()
	r.f = nil
	return err
}
