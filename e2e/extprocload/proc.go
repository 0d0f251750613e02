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
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return Usage{}, err
	}
	for _, line := range strings.Split(string(status), "\n") {
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			if err != nil {
				return Usage{}, fmt.Errorf("/proc/%d/status: VmHWM %q", pid, v)
			}
			u.PeakRSS = kb << 10
		}
	}
	return u, nil
}
