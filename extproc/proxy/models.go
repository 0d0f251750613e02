package proxy

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/tidwall/gjson"

	"github.com/kvbandit/kvbandit/extproc"
	"github.com/kvbandit/kvbandit/extproc/openai"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/engine"
)

// ModelsPath lists the fleet's models: the proxy answers GET /v1/models
// (and GET /v1/models/{id}) itself instead of forwarding it to one worker.
const ModelsPath = "/v1/models"

// Fleet lists the current endpoint set and the LoRA adapters each
// endpoint's worker reported. *engine.Engine implements it.
type Fleet interface {
	Endpoints() []*routing.EndpointState
	ScrapedAdapters(ep routing.EndpointKey) []routing.ModelName
}

var _ Fleet = (*engine.Engine)(nil)

// Limits of the /v1/models listing: a worker's answer is hostile input.
const (
	// DefaultModelsCacheTTL is how long a worker's /v1/models answer (or
	// failure) is reused before it is asked again.
	DefaultModelsCacheTTL = 5 * time.Second
	// DefaultModelsTimeout bounds one worker's /v1/models request.
	DefaultModelsTimeout = time.Second
	// MaxModelsResponseBytes bounds a worker's /v1/models body; a larger
	// one counts as a failed answer.
	MaxModelsResponseBytes = 1 << 20
	// MaxModelsPerWorker is the most entries taken from one worker's
	// answer (the rest are ignored).
	MaxModelsPerWorker = 1024
	// MaxModelIDBytes bounds a model id; longer ids are ignored.
	MaxModelIDBytes = 512
	// MaxFleetModels bounds the listing (ids after the first
	// MaxFleetModels in sorted order are left out).
	MaxFleetModels = 4096
	// modelsFetchParallel is the number of workers asked at once.
	modelsFetchParallel = 16
	// ownedByDeclared is owned_by of a model only discovery declares.
	ownedByDeclared = "kvbandit"
)

// Model is one entry of an OpenAI model list.
type Model struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	OwnedBy string `json:"owned_by"`
}

// ModelList is the OpenAI list of models.
type ModelList struct {
	Object string  `json:"object"`
	Data   []Model `json:"data"`
}

// errModelsFetch marks a worker's /v1/models answer that could not be used.
var errModelsFetch = errors.New("worker /v1/models")

// workerModels is one worker's last /v1/models answer.
type workerModels struct {
	at     time.Time // when it was asked
	models []Model   // the last good answer (kept through failures)
}

// modelLister builds the fleet's model list: the union of the models each
// endpoint declares through discovery (models, adapters), the LoRA adapters
// the load scraper saw, and what each worker answers on /v1/models. Worker
// answers are fetched when a listing is asked for and older than the TTL;
// one refresh runs at a time (later callers wait for it, or for their
// context), each worker is asked with a timeout, and a worker that fails
// keeps its last good answer until it leaves the endpoint set.
type modelLister struct {
	fleet   Fleet
	rt      http.RoundTripper
	log     *slog.Logger
	clk     clock.Clock
	ttl     time.Duration
	timeout time.Duration
	// sem serialises refreshes and guards cache.
	sem   chan struct{}
	cache map[routing.EndpointKey]*workerModels
}

func newModelLister(fleet Fleet, rt http.RoundTripper, log *slog.Logger, clk clock.Clock, ttl, timeout time.Duration) *modelLister {
	return &modelLister{fleet: fleet, rt: rt, log: log, clk: clk, ttl: cmp.Or(ttl, DefaultModelsCacheTTL), timeout: cmp.Or(timeout, DefaultModelsTimeout),
		sem: make(chan struct{}, 1), cache: map[routing.EndpointKey]*workerModels{}}
}

// list returns the fleet's models, deduplicated by id and sorted.
func (l *modelLister) list(ctx context.Context) ([]Model, error) {
	eps := slices.SortedFunc(slices.Values(l.fleet.Endpoints()), func(a, b *routing.EndpointState) int { return cmp.Compare(a.Key, b.Key) })
	select {
	case l.sem <- struct{}{}:
	case <-ctx.Done():
		return nil, context.Cause(ctx)
	}
	defer func() { <-l.sem }()
	l.refresh(ctx, eps)

	byID := map[string]Model{}
	add := func(m Model) {
		if _, ok := byID[m.ID]; !ok && len(m.ID) <= MaxModelIDBytes && m.ID != "" {
			byID[m.ID] = m
		}
	}
	// Workers' own answers first: they carry created and owned_by.
	for _, e := range eps {
		if c := l.cache[e.Key]; c != nil {
			for _, m := range c.models {
				add(m)
			}
		}
	}
	for _, e := range eps {
		for _, names := range [][]routing.ModelName{e.Models, e.Adapters, l.fleet.ScrapedAdapters(e.Key)} {
			for _, n := range names {
				add(Model{ID: string(n), Object: "model", OwnedBy: ownedByDeclared})
			}
		}
	}
	out := slices.SortedFunc(func(yield func(Model) bool) {
		for _, m := range byID {
			if !yield(m) {
				return
			}
		}
	}, func(a, b Model) int { return strings.Compare(a.ID, b.ID) })
	if len(out) > MaxFleetModels {
		out = out[:MaxFleetModels]
	}
	return out, nil
}

// refresh asks the endpoints whose answer is older than the TTL, and
// forgets the endpoints that left the set. The caller holds sem.
func (l *modelLister) refresh(ctx context.Context, eps []*routing.EndpointState) {
	now := l.clk.Now()
	keep := make(map[routing.EndpointKey]bool, len(eps))
	var stale []routing.EndpointKey
	for _, e := range eps {
		keep[e.Key] = true
		if c := l.cache[e.Key]; c == nil || now.Sub(c.at) >= l.ttl {
			stale = append(stale, e.Key)
		}
	}
	for k := range l.cache {
		if !keep[k] {
			delete(l.cache, k)
		}
	}
	if len(stale) == 0 {
		return
	}
	type result struct {
		key    routing.EndpointKey
		models []Model
		err    error
	}
	results := make([]result, len(stale))
	work := make(chan int)
	var wg sync.WaitGroup
	for range min(modelsFetchParallel, len(stale)) {
		wg.Go(func() {
			for i := range work {
				ms, err := l.fetch(ctx, stale[i])
				results[i] = result{stale[i], ms, err}
			}
		})
	}
	for i := range stale {
		work <- i
	}
	close(work)
	wg.Wait()
	for _, r := range results {
		c := l.cache[r.key]
		if c == nil {
			c = &workerModels{}
			l.cache[r.key] = c
		}
		c.at = now
		if r.err != nil {
			l.log.Debug("model listing: worker answer not used; keeping its last one", "endpoint", r.key, "err", r.err)
			continue
		}
		c.models = r.models
	}
}

// fetch asks one worker for GET /v1/models, bounded by the timeout and
// MaxModelsResponseBytes, and keeps at most MaxModelsPerWorker entries
// with a string id of at most MaxModelIDBytes.
func (l *modelLister) fetch(ctx context.Context, ep routing.EndpointKey) ([]Model, error) {
	ctx, cancel := context.WithTimeout(ctx, l.timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+string(ep)+ModelsPath, http.NoBody)
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %w", errModelsFetch, ep, err)
	}
	req.Header.Set("Accept", "application/json")
	resp, err := l.rt.RoundTrip(req)
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %w", errModelsFetch, ep, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%w: %s: status %d", errModelsFetch, ep, resp.StatusCode)
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, MaxModelsResponseBytes+1))
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %w", errModelsFetch, ep, err)
	}
	if len(body) > MaxModelsResponseBytes {
		return nil, fmt.Errorf("%w: %s: more than %d bytes", errModelsFetch, ep, MaxModelsResponseBytes)
	}
	return parseModels(body)
}

// parseModels reads an OpenAI model list, skipping entries without a
// usable id; created and owned_by are taken when they have the right type.
func parseModels(body []byte) ([]Model, error) {
	// Depth first, without recursion: gjson.ValidBytes recurses once per
	// level, and 16 workers answering 1 MiB nested 500,000 deep took the
	// process past 1 GiB.
	if err := openai.CheckJSON(body); err != nil {
		return nil, fmt.Errorf("%w: %w", errModelsFetch, err)
	}
	data := gjson.GetBytes(body, "data")
	if !data.IsArray() {
		return nil, fmt.Errorf("%w: no data array", errModelsFetch)
	}
	var out []Model
	data.ForEach(func(_, v gjson.Result) bool {
		id := v.Get("id")
		if id.Type != gjson.String || id.Str == "" || len(id.Str) > MaxModelIDBytes {
			return true
		}
		m := Model{ID: id.Str, Object: "model", OwnedBy: ownedByDeclared}
		if c := v.Get("created"); c.Type == gjson.Number {
			m.Created = c.Int()
		}
		if o := v.Get("owned_by"); o.Type == gjson.String && len(o.Str) <= MaxModelIDBytes {
			m.OwnedBy = o.Str
		}
		out = append(out, m)
		return len(out) < MaxModelsPerWorker
	})
	return out, nil
}

// models answers GET/HEAD /v1/models (the fleet's list) and
// GET/HEAD /v1/models/{id} (one entry, or 404 model_not_found).
func (p *Proxy) models(w http.ResponseWriter, r *http.Request, clean, class string) {
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		closeUnread(w, r)
		p.fail(w, class, &extproc.MethodError{Method: r.Method, Path: clean, Allow: "GET, HEAD"})
		return
	}
	list, err := p.modelList.list(r.Context())
	if err != nil {
		p.metrics.request(class, 0) // the client went away while waiting
		return
	}
	if list == nil {
		list = []Model{} // "data":[], never null
	}
	var v any = ModelList{Object: "list", Data: list}
	if id, ok := strings.CutPrefix(clean, ModelsPath+"/"); ok {
		i := slices.IndexFunc(list, func(m Model) bool { return m.ID == id })
		if i < 0 {
			p.fail(w, class, fmt.Errorf("%w: %.256q", routing.ErrModelNotFound, id))
			return
		}
		v = list[i]
	}
	js, err := json.Marshal(v)
	if err != nil {
		p.fail(w, class, fmt.Errorf("encoding models: %w", err))
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusOK)
	if r.Method != http.MethodHead {
		_, _ = w.Write(js)
	}
	p.metrics.request(class, http.StatusOK)
}
