package clock

import (
	"testing"
	"time"
)

func TestVirtualRunsCallbacksInOrder(t *testing.T) {
	start := time.Unix(1000, 0)
	v := NewVirtual(start)
	var got []int
	v.AfterFunc(3*time.Second, func() { got = append(got, 3) })
	v.AfterFunc(time.Second, func() {
		got = append(got, 1)
		v.AfterFunc(time.Second, func() { got = append(got, 2) })
	})
	stop := v.AfterFunc(2500*time.Millisecond, func() { got = append(got, 99) })
	if !stop.Stop() || stop.Stop() {
		t.Fatal("Stop should succeed once")
	}
	v.Advance(start.Add(2 * time.Second))
	if len(got) != 2 || got[0] != 1 || got[1] != 2 {
		t.Fatalf("after 2s got %v", got)
	}
	v.Step(5 * time.Second)
	if len(got) != 3 || got[2] != 3 {
		t.Fatalf("after 7s got %v", got)
	}
	if !v.Now().Equal(start.Add(7 * time.Second)) {
		t.Fatalf("now = %v", v.Now())
	}
	if _, ok := v.NextAt(); ok {
		t.Fatal("queue should be empty")
	}
}
