package extprocload

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
)

// Usage is a process's own accounting, from /proc (Linux).
type Usage struct {
	// CPU is user + system time.
	CPU time.Duration
	// PeakRSS is VmHWM, the resident set's high-water mark, in bytes.
	PeakRSS int64
}

// ReadUsage reads pid's CPU time and peak RSS.
func ReadUsage(pid int) (Usage, error) {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return Usage{}, err
	}
	// Fields after the command name (which may hold spaces) start after
	// the last ')': state is field 3, utime 14, stime 15.
	s := string(stat)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	if len(f) < 13 {
		return Usage{}, fmt.Errorf("/proc/%d/stat: short", pid)
	}
	ut, err1 := strconv.ParseInt(f[11], 10, 64)
	st, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return Usage{}, fmt.Errorf("/proc/%d/stat: bad times", pid)
	}
	const ticks = 100 // USER_HZ on Linux
	u := Usage{CPU: time.Duration(ut+st) * time.Second / ticks}
	hwm, err := statusBytes(pid, "VmHWM")
	if err != nil {
		return Usage{}, err
	}
	u.PeakRSS = hwm
	return u, nil
}

// ReadRSS reads pid's current resident set (VmRSS), in bytes.
func ReadRSS(pid int) (int64, error) { return statusBytes(pid, "VmRSS") }

// statusBytes reads one kB field of /proc/pid/status, in bytes.
func statusBytes(pid int, field string) (int64, error) {
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(status), "\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			if err != nil {
				return 0, fmt.Errorf("/proc/%d/status: %s %q", pid, field, v)
			}
			return kb << 10, nil
		}
	}
	return 0, fmt.Errorf("/proc/%d/status: no %s", pid, field)
}

// SampleRSS reads pid's resident set every period until stop is called,
// which returns the largest value seen (0 if none could be read). Unlike
// VmHWM it covers only the sampled interval, so one process can be measured
// under several loads in turn.
func SampleRSS(pid int, period time.Duration) (stop func() int64) {
	done := make(chan struct{})
	peak := make(chan int64, 1)
	go func() {
		var top int64
		tick := time.NewTicker(period)
		defer tick.Stop()
		for {
			if rss, err := ReadRSS(pid); err == nil {
				top = max(top, rss)
			}
			select {
			case <-done:
				peak <- top
				return
			case <-tick.C:
			}
		}
	}()
	return func() int64 { close(done); return <-peak }
}
