package envoysim

import (
	"sync"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
)

// ---- the inbox ----------------------------------------------------------------

// inbox queues what the server sends without ever blocking the receiver,
// so a message and the end of the stream right behind it are both there
// when the loop looks.
type inbox struct {
	mu     sync.Mutex
	items  []event
	notify chan struct{}
}

func newInbox() *inbox { return &inbox{notify: make(chan struct{}, 1)} }

func (b *inbox) push(ev event) {
	b.mu.Lock()
	b.items = append(b.items, ev)
	b.mu.Unlock()
	select {
	case b.notify <- struct{}{}:
	default:
	}
}

func (b *inbox) drain() []event {
	b.mu.Lock()
	defer b.mu.Unlock()
	items := b.items
	b.items = nil
	return items
}

// ---- the send queue -----------------------------------------------------------

type sendItem struct {
	msg   *extprocv3.ProcessingRequest
	close bool
}

// sendQueue decouples the loop from gRPC flow control: push never blocks.
type sendQueue struct {
	mu    sync.Mutex
	cond  *sync.Cond
	items []sendItem
}

func newSendQueue() *sendQueue {
	q := &sendQueue{}
	q.cond = sync.NewCond(&q.mu)
	return q
}

func (q *sendQueue) push(it sendItem) {
	q.mu.Lock()
	q.items = append(q.items, it)
	q.mu.Unlock()
	q.cond.Signal()
}

func (q *sendQueue) pop() sendItem {
	q.mu.Lock()
	defer q.mu.Unlock()
	for len(q.items) == 0 {
		q.cond.Wait()
	}
	it := q.items[0]
	q.items = q.items[1:]
	return it
}
