package admission

import (
	"errors"
	"fmt"
	"math"
	"time"
)

// Policy orders the queue.
type Policy string

// Queue policies (Dynamo's --router-queue-policy values).
const (
	// PolicyFCFS admits by effective arrival (arrival − head start):
	// first come, first served, with priority as a head start. It
	// optimises tail TTFT. It is the default.
	PolicyFCFS Policy = "fcfs"
	// PolicyWSPT admits by (1 + head start seconds) / max(1, cost), highest
	// first (Smith's rule). It optimises mean TTFT.
	PolicyWSPT Policy = "wspt"
)

// Defaults applied by [Config.WithDefaults] to zero fields.
const (
	DefaultMaxWait   = 10 * time.Second
	DefaultMaxQueued = 1024
)

// Config configures a [Queue]. The zero value is a disabled queue.
type Config struct {
	// Threshold enables the queue when > 0. The queue itself only uses it
	// as the on/off switch; the caller's [Saturation] interprets it (an
	// endpoint is saturated when its active prefill tokens exceed
	// Threshold × max_num_batched_tokens). Unlike Dynamo, where 0.0 is a
	// valid enabled value, 0 means off here; use a tiny positive value for
	// "queue as soon as every endpoint has any prefill in flight".
	Threshold float64
	// Policy is fcfs (default when empty) or wspt.
	Policy Policy
	// MaxWait is the longest a request waits in the queue before it is
	// rejected with [ErrWaitExceeded], measured on the queue's clock from
	// the moment it was queued. 0 means DefaultMaxWait.
	MaxWait time.Duration
	// MaxQueued bounds the number of waiting requests; a request that
	// would exceed it gets [ErrQueueFull]. 0 means DefaultMaxQueued.
	MaxQueued int

	// OnWait, when set, observes the time each queued request spent in
	// the queue, once, when it leaves it (admitted, timed out or
	// cancelled). Requests admitted without queueing are not observed. It
	// is called from the waiting request's goroutine, outside any lock.
	OnWait func(time.Duration)
}

// Enabled reports whether the configuration turns the queue on.
func (c Config) Enabled() bool { return c.Threshold > 0 }

// WithDefaults returns c with zero fields set to their defaults.
func (c Config) WithDefaults() Config {
	if c.Policy == "" {
		c.Policy = PolicyFCFS
	}
	if c.MaxWait == 0 {
		c.MaxWait = DefaultMaxWait
	}
	if c.MaxQueued == 0 {
		c.MaxQueued = DefaultMaxQueued
	}
	return c
}

// Validate reports every invalid field, each error naming its Go field (the
// flag or file loader maps them to its own names). Zero values are valid:
// they mean "off" or "default".
func (c Config) Validate() error {
	var errs []error
	if math.IsNaN(c.Threshold) || math.IsInf(c.Threshold, 0) || c.Threshold < 0 {
		errs = append(errs, fmt.Errorf("Threshold: must be a finite number >= 0 (0 disables the queue), got %v", c.Threshold))
	}
	switch c.Policy {
	case "", PolicyFCFS, PolicyWSPT:
	default:
		errs = append(errs, fmt.Errorf("Policy: must be %q or %q, got %q", PolicyFCFS, PolicyWSPT, c.Policy))
	}
	if c.MaxWait < 0 {
		errs = append(errs, fmt.Errorf("MaxWait: must be >= 0 (0 means %v), got %v", DefaultMaxWait, c.MaxWait))
	}
	if c.MaxQueued < 0 {
		errs = append(errs, fmt.Errorf("MaxQueued: must be >= 0 (0 means %d), got %d", DefaultMaxQueued, c.MaxQueued))
	}
	return errors.Join(errs...)
}
