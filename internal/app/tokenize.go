package app

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbandit/kvbandit/internal/cmdline"
	"github.com/kvbandit/kvbandit/tokenizer/models"
)

// tokenizerRegistry builds the model → tokenizer registry from --tokenizer
// and the config's models map.
func tokenizerRegistry(def string, cfg *FileConfig, log *slog.Logger) *models.Registry {
	m := make(map[string]string, len(cfg.Models))
	for name, mc := range cfg.Models {
		m[name] = mc.Tokenizer
	}
	return models.New(models.Config{Default: def, Models: m, CacheBytes: cfg.Tokenizer.CacheBytes, Loader: nativeLoader}, log)
}

// runTokenize is `kvbandit tokenize`: text (or, with --chat, an OpenAI chat
// request) on stdin, the JSON array of token ids on stdout — the same code
// path the router uses.
func runTokenize(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("tokenize", flag.ContinueOnError)
	fs.SetOutput(stderr)
	path := fs.String("tokenizer", "", "tokenizer.json or a model directory (required)")
	chatMode := fs.Bool("chat", false, "stdin is an OpenAI chat completion request: render the model's chat template with the generation prompt, then tokenize")
	if err := cmdline.ParseFlags(fs, args); err != nil {
		return err
	}
	if *path == "" || fs.NArg() > 0 {
		return fmt.Errorf("%w: kvbandit tokenize --tokenizer PATH [--chat] < input", ErrUsage)
	}
	cfg := DefaultFileConfig()
	m, err := tokenizerRegistry(*path, &cfg, slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))).For("")
	if err != nil {
		return err
	}
	in, err := io.ReadAll(io.LimitReader(stdin, 64<<20))
	if err != nil {
		return err
	}
	var ids []uint32
	if *chatMode {
		ci, err := models.ChatInput(in)
		if err != nil {
			return err
		}
		ids, err = m.EncodeChat(ctx, ci)
		if err != nil {
			return err
		}
	} else if ids, err = m.Encode(ctx, string(in)); err != nil {
		return err
	}
	if ids == nil {
		ids = []uint32{}
	}
	return json.NewEncoder(stdout).Encode(ids)
}

// tokenizerCacheCollector exports the tokenizers' prefix-cache counters.
type tokenizerCacheCollector struct{ r *models.Registry }

var (
	tokCacheHits  = prometheus.NewDesc("kvbandit_tokenizer_cache_hits_total", "Prompt chunks found in the tokenizer's prefix cache.", []string{"tokenizer"}, nil)
	tokCacheMiss  = prometheus.NewDesc("kvbandit_tokenizer_cache_misses_total", "Prompt chunks encoded because the prefix cache did not hold them.", []string{"tokenizer"}, nil)
	tokCacheKeys  = prometheus.NewDesc("kvbandit_tokenizer_cache_block_keys_total", "Block keys of prompts given to the engine by the tokenizer's prefix cache, by source: reused (stored with a chunk the cache served) or hashed.", []string{"tokenizer", "source"}, nil)
	tokCacheBytes = prometheus.NewDesc("kvbandit_tokenizer_cache_bytes", "Bytes held by the tokenizer's prefix cache.", []string{"tokenizer"}, nil)
	chatRenders   = prometheus.NewDesc("kvbandit_chat_render_total", "Chat template renders by path: fast (the template's compiled fast path) or engine (the Jinja engine).", []string{"tokenizer", "path"}, nil)
)

func (tokenizerCacheCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- tokCacheHits
	ch <- tokCacheMiss
	ch <- tokCacheKeys
	ch <- tokCacheBytes
	ch <- chatRenders
}

func (c tokenizerCacheCollector) Collect(ch chan<- prometheus.Metric) {
	for path, st := range c.r.CacheStats() {
		ch <- prometheus.MustNewConstMetric(tokCacheHits, prometheus.CounterValue, float64(st.Hits), path)
		ch <- prometheus.MustNewConstMetric(tokCacheMiss, prometheus.CounterValue, float64(st.Misses), path)
		ch <- prometheus.MustNewConstMetric(tokCacheKeys, prometheus.CounterValue, float64(st.KeysReused), path, "reused")
		ch <- prometheus.MustNewConstMetric(tokCacheKeys, prometheus.CounterValue, float64(st.KeysHashed), path, "hashed")
		ch <- prometheus.MustNewConstMetric(tokCacheBytes, prometheus.GaugeValue, float64(st.Bytes), path)
	}
	for path, st := range c.r.ChatRenderStats() {
		ch <- prometheus.MustNewConstMetric(chatRenders, prometheus.CounterValue, float64(st.Fast), path, "fast")
		ch <- prometheus.MustNewConstMetric(chatRenders, prometheus.CounterValue, float64(st.Engine), path, "engine")
	}
}
