package sim

import "time"

// stepEvent is a worker's step end; gen tells stale ones apart.
type stepEvent struct {
	at     time.Duration
	worker int32
	gen    uint64
}

// stepHeap is a binary min-heap of step ends (ties by worker).
type stepHeap []stepEvent

func (h stepHeap) less(i, j int) bool {
	if h[i].at != h[j].at {
		return h[i].at < h[j].at
	}
	return h[i].worker < h[j].worker
}

func (h stepHeap) peek() (stepEvent, bool) {
	if len(h) == 0 {
		return stepEvent{}, false
	}
	return h[0], true
}

func (h *stepHeap) push(e stepEvent) {
	*h = append(*h, e)
	a := *h
	for i := len(a) - 1; i > 0; {
		p := (i - 1) / 2
		if !a.less(i, p) {
			break
		}
		a[i], a[p] = a[p], a[i]
		i = p
	}
}

func (h *stepHeap) pop() stepEvent {
	a := *h
	top := a[0]
	n := len(a) - 1
	a[0] = a[n]
	a = a[:n]
	for i := 0; ; {
		l, m := 2*i+1, i
		if l < n && a.less(l, m) {
			m = l
		}
		if r := l + 1; r < n && a.less(r, m) {
			m = r
		}
		if m == i {
			break
		}
		a[i], a[m] = a[m], a[i]
		i = m
	}
	*h = a
	return top
}
